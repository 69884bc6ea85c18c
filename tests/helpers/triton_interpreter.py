"""The Triton interpreter's launch cost, cut for the suite: every launch re-patches triton.language's builtins
(and restores them after), finding them with inspect.getmembers over each module, ~0.24 ms a launch; the
deterministic-mode tests launch ~90k kernels, and a profile of the slowest one put 16% of its time there. The
builtins a module holds do not change between launches, so their list is looked up once (each launch still
patches and restores them). A Triton without that function, or with another signature, is left as it is."""
from __future__ import annotations

import inspect


def cache_builtin_lookup() -> bool:
    """Installs the cached lookup; False when this Triton's interpreter has no _patch_builtin(pkg, builder, scope)."""
    try:
        from triton.runtime import interpreter
        from triton.language.core import is_builtin
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None:
        return False
    if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return False
    builtins_of: dict[int, tuple[object, list[tuple[str, object]]]] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        found = builtins_of.get(id(pkg))
        if found is None or found[0] is not pkg:  # looked up while unpatched: the first launch's, before any patch
            found = builtins_of[id(pkg)] = (pkg, [(name, member) for name, member in inspect.getmembers(pkg)
                                                   if is_builtin(member)])
        for name, member in found[1]:
            patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin
    return True
