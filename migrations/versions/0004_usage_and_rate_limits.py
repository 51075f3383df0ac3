"""usage accounting and rate limits: usage_records, rate_limits

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_records",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("api_key", sa.String(length=64), nullable=True),
        sa.Column("adapter", sa.String(length=64), nullable=True),
        sa.Column("adapter_digest", sa.String(length=64), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("latency_ms", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_records")),
    )
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_usage_records_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_usage_records_api_key"), ["api_key"], unique=False)
        batch_op.create_index(batch_op.f("ix_usage_records_adapter"), ["adapter"], unique=False)
    op.create_table(
        "rate_limits",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("kind IN ('key', 'adapter')", name=op.f("ck_rate_limits_kind_valid")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rate_limits")),
        sa.UniqueConstraint("kind", "name", name="uq_rate_limits_kind_name"),
    )


def downgrade() -> None:
    op.drop_table("rate_limits")
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_usage_records_adapter"))
        batch_op.drop_index(batch_op.f("ix_usage_records_api_key"))
        batch_op.drop_index(batch_op.f("ix_usage_records_at"))
    op.drop_table("usage_records")
