"""Configuration: the YAML profile, its validation, user directories, chat templates."""
