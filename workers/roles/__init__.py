"""The roles, one module each; `registry` lists them."""
