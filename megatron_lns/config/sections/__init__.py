"""The schema's sections, one file each; ``config/schema.py`` assembles them."""
