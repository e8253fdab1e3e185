"""Training data: the Countdown generator, MATH-style loaders and the paper's prompt templates.

See :mod:`openrlhf_lpo.data.templates`, :mod:`openrlhf_lpo.data.countdown`,
:mod:`openrlhf_lpo.data.loaders` and the ``python -m openrlhf_lpo.data.prepare`` command.
"""
