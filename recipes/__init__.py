"""The qualification recipes as pytest modules, shipped in the wheel: one module per recipe
(``native_text.py``, ``kquant_target_plus_dflash.py``), one test per progress label.

Run them from any directory with ``python -m pytest --pyargs qualify.recipes``, or in a checkout
with ``pytest recipes`` (the checkout keeps them at its top level; the wheel ships them as this
package, pyproject.toml's package-dir). The plugin (:mod:`qualify.interfaces.plugin`) collects every
module here and runs each as one :class:`qualify.run.qualification.QualificationRun`. May import
the plugin and :mod:`qualify.run`; nothing imports this package.
"""
