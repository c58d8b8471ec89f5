# Hand-written, not exported: the short names users type.
"""PaliGemma from scratch: the library exported from the chapters of the book.

    from paligemma_lib import load_pretrained, PaliGemmaProcessor, answer
    model = load_pretrained("path/to/checkpoint")
    processor = PaliGemmaProcessor.from_pretrained("path/to/checkpoint")
    answer(model, processor, "photo.jpg", "caption en")

The modules follow the chapters: `processing` (images, tokenizer, processor),
`siglip`, `gemma`, `paligemma` (the model), `kv_cache` and `generation`,
`weights` (loading and saving checkpoints).
"""

from importlib.metadata import PackageNotFoundError, version

from .generation import answer, generate
from .processing import PaliGemmaProcessor, load_image
from .weights import draw_boxes, load_pretrained, save_pretrained

try:
    __version__ = version("paligemma_lib")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    "PaliGemmaProcessor",
    "__version__",
    "answer",
    "draw_boxes",
    "generate",
    "load_image",
    "load_pretrained",
    "save_pretrained",
]
