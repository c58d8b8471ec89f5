# Hand-written, not exported: the short names users type.
"""PaliGemma from scratch: the library exported from the chapters of the book.

    from paligemma_lib import load_pretrained, PaliGemmaProcessor, answer
    model = load_pretrained("path/to/checkpoint")
    processor = PaliGemmaProcessor.from_pretrained("path/to/checkpoint")
    answer(model, processor, "photo.jpg", "caption en")

The modules follow the chapters: `image_processing`, `tokenization`,
`processing` (the processor), `model_files`, `boxes`, `siglip`, `gemma`,
`paligemma` (the model), `kv_cache` and `generation`, `weights` (loading and
saving checkpoints); the API reference in the book lists them all.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("paligemma_lib")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

# name -> module. Imported on first use (PEP 562), so that `import paligemma_lib`
# and the command line start without loading torch until they need it.
_WHERE = {
    "PaliGemmaProcessor": "processing",
    "answer": "generation",
    "draw_boxes": "boxes",
    "draw_segments": "segmentation",
    "generate": "generation",
    "load_image": "image_processing",
    "load_pretrained": "weights",
    "parse_segments": "segmentation",
    "save_pretrained": "weights",
}
__all__ = ["__version__", *_WHERE]


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'paligemma_lib' has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted({*globals(), *__all__})
