"""The rollout side: engines, generate functions, rewards, and the manager that drives them."""
