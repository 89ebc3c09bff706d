"""``import popart`` in a child of ``poptorch-lite run``: the real one, or the parent's stand-in.

``alias.reach_children`` puts this folder's parent first on a child's path; the import is
replaced by ``side_modules.in_child``'s choice, as ``poptorch`` is by the alias.
"""

from poptorch_lite.side_modules import in_child

in_child("popart", __file__)
