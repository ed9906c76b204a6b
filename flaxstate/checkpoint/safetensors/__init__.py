"""Weights in and out as safetensors files: HF-style folders that vLLM and transformers load, and runs started
from them, named and laid out by a `WeightMap`.

- `export`: `export_safetensors`, a run's params out, a few tensors at a time;
- `reader`: `SafetensorsReader`, a run's start from the files, each device's part read alone;
- `weight_map`: `WeightMap`, one table between tree paths and the files' names and layouts, read both ways;
- `naming`: `rename=`/`transpose=`, and `map=` checked at the door;
- `files`: the format, a folder's files and index, a file in a bucket.
"""

from flaxstate.checkpoint.safetensors.export import READ_BYTES, STAGING, export_safetensors
from flaxstate.checkpoint.safetensors.files import INDEX, MAX_HEADER_BYTES, SINGLE
from flaxstate.checkpoint.safetensors.reader import SafetensorsReader
from flaxstate.checkpoint.safetensors.weight_map import WeightMap

__all__ = [
    "INDEX",
    "MAX_HEADER_BYTES",
    "READ_BYTES",
    "SINGLE",
    "STAGING",
    "SafetensorsReader",
    "WeightMap",
    "export_safetensors",
]
