"""database blob store: blobs and blob_chunks

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 17:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "blobs",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("num_chunks", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_blobs")),
    )
    op.create_table(
        "blob_chunks",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["digest"], ["blobs.digest"], name=op.f("fk_blob_chunks_digest_blobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("digest", "seq", name=op.f("pk_blob_chunks")),
    )


def downgrade() -> None:
    op.drop_table("blob_chunks")
    op.drop_table("blobs")
