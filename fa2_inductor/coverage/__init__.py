"""``python -m fa2_inductor.coverage``: which Hugging Face families the pass rewrites, on this install.

Every model family the installed transformers knows is built tiny from its config class (random weights,
nothing downloaded), compiled with ``backend="fa2_inductor"`` on CPU in a child process with a time limit,
and reported per family × attention implementation: sites rewritten of the sites the pass recognised, the
refusal reasons, and how far the compiled logits are from the uncompiled model's.

Modules: ``configs`` shrinks a config, ``models`` enumerates families and builds a model with inputs,
``measure`` runs one case (in the child), ``run`` runs cases in children with a time limit, ``results``
holds the row and its status, ``report`` prints the table and writes the JSON.
"""
