"""What operators and tools call: the ``qualify`` console script and its commands (``cli``, the
``*_command`` modules, ``console``), the pytest plugin, the ``--json`` documents, the console's
tables and the HTML report. Only here are command lines parsed.

The top layer: may import every other package of ``qualify`` (import-linter, ``pyproject.toml``).
"""
