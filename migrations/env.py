"""Alembic environment: always run with a connection handed in by `ampwatch.server.db.upgrade`."""

from alembic import context

from ampwatch.server.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
