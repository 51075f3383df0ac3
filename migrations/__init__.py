"""Alembic environment and revisions of the registry database (see `lora_registry.migrate`)."""
