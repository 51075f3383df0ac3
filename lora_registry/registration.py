"""The validation half of a registration: stage the upload, check it, and store its blobs.

Kept apart from `service.py` because it imports torch (through the adapter reader); read-only registry
use (listing, following events) never loads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.lora.adapter_checkpoint import WEIGHTS_FILE, AdapterCheckpoint
from lora_registry.blobstore import BlobStore
from lora_registry.progress import NoProgress, ProgressReporter
from lora_registry.settings import RegistrySettings
from lora_registry.staging import UploadLimits, stage_upload
from lora_registry.validation import load_base_model, max_adapter_bytes, model_fingerprint, validate_adapter


@dataclass(slots=True)
class PreparedUpload:
    """A validated adapter waiting in the staging dir; `store` moves it into the blob store."""

    checkpoint: AdapterCheckpoint
    config_bytes: bytes
    weights_file: Path
    source: str
    model_fingerprint: str
    progress: ProgressReporter
    config_digest: str = ""
    weights_digest: str = ""

    def store(self, blobs: BlobStore) -> list[str]:
        """Write both blobs; return the digests of the blobs that did not exist before."""
        new: list[str] = []
        self.config_digest, created = blobs.put_bytes(self.config_bytes)
        if created:
            new.append(self.config_digest)
        advance = self.progress.phase("hashing + storing", self.weights_file.stat().st_size)
        try:
            self.weights_digest, created = blobs.put_file(self.weights_file, advance)
        except BaseException:
            for digest in new:
                blobs.delete(digest)
            raise
        if created:
            new.append(self.weights_digest)
        return new


@contextmanager
def prepare(
    source: Path, model_path: Path, settings: RegistrySettings, progress: ProgressReporter | None = None
) -> Iterator[PreparedUpload]:
    """Stage `source` (dir or zip) and validate it against the base model at `model_path`."""
    progress = progress or NoProgress()
    model = load_base_model(model_path)
    limits = UploadLimits(
        settings.max_upload_bytes,
        settings.max_unpacked_bytes,
        settings.max_zip_entries,
        max_ratio=settings.max_zip_ratio,
        max_weights_bytes=max_adapter_bytes(model, settings.max_lora_rank),
    )
    with stage_upload(Path(source), settings.data_dir / "tmp", limits, progress) as staged:
        checkpoint, config_bytes = validate_adapter(
            staged.directory, model, settings.max_lora_rank, settings.lora_side_budget
        )
        yield PreparedUpload(
            checkpoint=checkpoint,
            config_bytes=config_bytes,
            weights_file=staged.directory / WEIGHTS_FILE,
            source=staged.source,
            model_fingerprint=model_fingerprint(model),
            progress=progress,
        )
