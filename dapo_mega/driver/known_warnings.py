"""Known, harmless library warnings go to the run's log file once, not between the step lines.

On a CPU (and on GPUs without Apex) megatron-core warns at import that Apex / Transformer
Engine are missing and it falls back to torch implementations, and torch warns about
collectives megatron-core still calls by their old names. They say nothing about the run,
and a dozen of them between the step lines hide the lines. `route_known_warnings` is
called once at start-up, before megatron-core is imported: a warning matching
`KNOWN_WARNINGS` is written once (per distinct text) to `<run_dir>/logs/warnings[-rank<R>].log`;
every other warning reaches the console as before.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from pathlib import Path
from typing import Callable, List, Optional, Set, TextIO, Tuple, Type, Union

KNOWN_WARNINGS: Tuple[Tuple[str, str], ...] = (
    (r"(Apex|Transformer Engine).* not installed", "megatron-core falls back to torch implementations"),
    (r"all_gather_into_tensor` is deprecated|_all_gather_base` is a private function",
     "megatron-core calls torch's deprecated all-gather names"),
    (r"_reduce_scatter_base` is a private function|reduce_scatter_tensor` is deprecated",
     "megatron-core calls torch's deprecated reduce-scatter names"),
    (r"torch\.distributed\.reduce_op.* is deprecated", "megatron-core uses torch's old ReduceOp name"),
    (r"TypedStorage is deprecated", "torch storage API used by checkpoint libraries"),
    (r"full scope is deprecated\. Use empty cuda_graph_scope", "megatron-core's default of a CUDA-graph field"),
    (r"\.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
     "megatron-core reads .grad of a parameter view on the CPU path (backends/megatron/cpu_support.py)"),
)
"""(regular expression searched in the warning's text, why it is harmless)."""


class _Router:
    """The `warnings.showwarning` replacement installed by `route_known_warnings`."""

    def __init__(self, log_path: Path, show: Callable[..., None]):
        self.log_path = log_path
        self.show = show
        self.patterns = [(re.compile(p), why) for p, why in KNOWN_WARNINGS]
        self.seen: Set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, message: Union[Warning, str], category: Type[Warning], filename: str, lineno: int,
                 file: Optional[TextIO] = None, line: Optional[str] = None) -> None:
        text = str(message)
        why = next((why for pattern, why in self.patterns if pattern.search(text)), None)
        if why is None:
            self.show(message, category, filename, lineno, file, line)
            return
        with self.lock:
            if text in self.seen:
                return
            self.seen.add(text)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "a") as f:
                f.write(f"{getattr(category, '__name__', category)} at {filename}:{lineno} ({why}): {text}\n")


def route_known_warnings(run_dir: Path, rank: Optional[int] = None) -> Path:
    """Send known harmless warnings of this process to the run's warnings log (see the module
    docstring); returns the log's path. Calling it again only changes the log's path."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    path = Path(run_dir) / "logs" / ("warnings.log" if rank == 0 else f"warnings-rank{rank}.log")
    current = warnings.showwarning
    if isinstance(current, _Router):
        current.log_path = path
    else:
        warnings.showwarning = _Router(path, current)
    for pattern, _ in KNOWN_WARNINGS:  # shown once per text by the router, whatever the filters say
        warnings.filterwarnings("always", message=f".*(?:{pattern})")
    return path


def known_warning_lines(log_path: Path) -> List[str]:
    """The lines of a warnings log (empty when none was written)."""
    return Path(log_path).read_text().splitlines() if Path(log_path).exists() else []
