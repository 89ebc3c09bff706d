"""``import poptorch`` in a child of a process that made ``poptorch`` poptorch_lite.

``alias.alias_poptorch`` puts this folder's parent on the child processes' path, first after the
script's folder (``sys.path``, which ``multiprocessing``'s spawned children copy, and
``PYTHONPATH``, which any subprocess inherits), so a child's
``import poptorch``, or its unpickling of anything from a module that imports ``poptorch``,
gets the same alias as its parent. The alias replaces this module in ``sys.modules``, and the
import returns poptorch_lite itself.
"""

from poptorch_lite.alias import alias_poptorch

alias_poptorch()
