"""``python -m fa2_inductor.bench``: forward-attention TFLOP/s of fa2_inductor next to torch SDPA's backends.

It runs the FlashAttention papers' shapes (batch·seqlen = 16384 tokens, heads·head_dim = 2048) for every
seqlen, head dim, dtype and causal flag asked for, and in each cell times every implementation on the same
inputs. Before a cell is timed each implementation's output is checked against SDPA's; a wrong one is
marked WRONG and not timed, and one that refuses the cell (e.g. cuDNN at head dim 256) is marked n/a
with the reason. The table is printed cell by cell, the JSON is rewritten after every cell (a run cut
short keeps what it measured) and a PNG plots TFLOP/s against seqlen, as the papers do.

Modules, one job each: ``cases`` (shapes, FLOPs, inputs), ``timing`` (the timers), ``implementations``
(what is timed and the SDPA check), ``measure`` (one cell), ``report`` (table, JSON, environment),
``plot``, ``masks`` (the ``--masks`` rows), ``masked_backward`` (the ``--backward --masks`` rows: masked
training next to FlexAttention), ``overhead`` (the ``--overhead`` rows: µs per call at a tiny shape)
and ``cli``.

The FLOP count, the timers and the JSON helpers are importable for other benchmarks: ``attention_flops``,
``tflops``, ``time_cuda``, ``time_cpu``, ``time_calls``, ``input_set_count``, ``environment``, ``write_json``.
"""

from .cases import CAUSAL_CHOICES, DTYPES, PAPER_HIDDEN, PAPER_TOKENS, Cell, attention_flops, random_input_sets
from .cases import sweep_cells, tflops
from .cli import CPU_SMOKE_FLAGS, FULL_SWEEP, QUICK_SWEEP, exit_without_cuda, main, parse_args, replot, run
from .cli import run_settings
from .implementations import DEFAULT_IMPLS, FA2, IMPLEMENTATIONS, TOLERANCES, NotAvailable, attention_by_hand
from .implementations import compare_to_reference, sdpa_reference
from .masks import mask_rows
from .measure import CellResult, Measurement, measure_cell, measure_together, ratio_name
from .plot import draw_plot
from .report import Progress, environment, group_title, ratio_summary, table_header, table_row, write_json
from .timing import (
    TIME_BUDGET_MS, affordable_counts, every_median, input_set_count, medians_in_turns, time_calls, time_cpu,
    time_cuda, time_in_turns,
)

__all__ = [
    "CAUSAL_CHOICES", "DTYPES", "PAPER_HIDDEN", "PAPER_TOKENS", "Cell", "attention_flops", "random_input_sets",
    "sweep_cells", "tflops",
    "CPU_SMOKE_FLAGS", "FULL_SWEEP", "QUICK_SWEEP", "exit_without_cuda", "main", "parse_args", "replot", "run",
    "run_settings",
    "DEFAULT_IMPLS", "FA2", "IMPLEMENTATIONS", "TOLERANCES", "NotAvailable", "attention_by_hand",
    "compare_to_reference", "sdpa_reference",
    "mask_rows",
    "CellResult", "Measurement", "measure_cell", "measure_together", "ratio_name",
    "draw_plot",
    "Progress", "environment", "group_title", "ratio_summary", "table_header", "table_row", "write_json",
    "TIME_BUDGET_MS", "affordable_counts", "every_median", "input_set_count", "medians_in_turns", "time_calls",
    "time_cpu", "time_cuda", "time_in_turns",
]
