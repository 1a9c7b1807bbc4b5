"""Low-precision formats and the layers that compute in them."""
