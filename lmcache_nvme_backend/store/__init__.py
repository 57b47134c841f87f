"""The chunk store (layer 3): index, capacity, write-back, validation on read, recovery.
``ChunkStore`` is the entry point; the rest of the package uses only what this exports."""

from .chunk_store import ChunkStore
from .index import IndexEntry
from .reads import ChunkRead, ReadPlan
from .roots import RootInfo
from .stats import Counter, ReadPath
from .writeback import ChunkWrite, SubmitResult, TaskOutcome

__all__ = ["ChunkRead", "ChunkStore", "ChunkWrite", "Counter", "IndexEntry", "ReadPath",
           "ReadPlan", "RootInfo", "SubmitResult", "TaskOutcome"]
