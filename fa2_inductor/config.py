"""User knobs, read when a graph is compiled.

rewrite_on_cpu: let the graph pass rewrite CPU graphs (off by default: the op is no faster than
    Inductor there). Tests turn it on to run the whole pipeline without a GPU.
"""

rewrite_on_cpu: bool = False
