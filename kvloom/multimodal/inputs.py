"""The plain data of a request's images, as the scheduler, the KV cache manager and the runner see them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class ImageFeature:
    """One image of a prompt.

    ``content_hash`` names the image's pixels (and how they were preprocessed): the encoder cache and the
    prefix cache key on it, so the same image reuses both and a different one never does.
    ``embed_positions``: the prompt positions whose embeddings the image's rows replace, in order (its
    ``<image>`` tokens; the tags between tiles keep their own embeddings). ``offset`` and ``end`` bound
    them. ``pixel_values``: the preprocessed tiles, a float32 numpy array [tiles, channels, size, size].
    """

    content_hash: str
    embed_positions: tuple[int, ...]
    pixel_values: Any
    num_rows: int = 0
    num_cols: int = 0

    @property
    def offset(self) -> int:
        return self.embed_positions[0]

    @property
    def end(self) -> int:
        """One past the last position the image's rows go to."""
        return self.embed_positions[-1] + 1

    @property
    def num_embeds(self) -> int:
        return len(self.embed_positions)
