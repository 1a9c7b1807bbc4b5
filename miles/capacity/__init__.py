"""The capacity model behind `miles simulate`: model shapes, fleets, and what a run costs on them."""
