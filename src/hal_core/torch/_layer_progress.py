"""Progress over the linear layers of a model, for :func:`quantize_model` and :func:`load_quantized`.

``progress`` is what those functions accept: None (quiet), True (``hal
bench``'s progress bar on stderr: redrawn on a terminal, one line per layer
otherwise), or a callable ``progress(done, total, name)`` called after each
layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["ProgressArg", "layer_progress"]

#: None, True, or ``callback(done, total, name)``.
ProgressArg = bool | Callable[[int, int, str], object] | None


@contextmanager
def layer_progress(progress: ProgressArg, total: int, verb: str) -> Iterator[Callable[[str], None]]:
    """Yield ``step(name)``, to call once a layer is done; ``verb`` describes the work on the bar."""
    if progress is None or progress is False:
        yield lambda name: None
        return
    if progress is True:
        from ..bench._progress import Progress  # hal bench's bar; imported only when asked for

        bar = Progress(total)
        try:
            yield lambda name: bar.step(f"{verb} {name}")
        finally:
            bar.close()
        return
    if not callable(progress):
        raise TypeError(f"argument 'progress': expected None, True or a callable (done, total, name), "
                        f"got {type(progress).__name__}")
    done = 0

    def step(name: str) -> None:
        nonlocal done
        done += 1
        progress(done, total, name)

    yield step
