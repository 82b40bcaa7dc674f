"""Memory: what a model needs, what a machine has, the plan that fits them."""
