"""The runtime's own errors (no torch import: ``import ravex`` stays light)."""

from __future__ import annotations

from ravex_convert.errors import RavexError

__all__ = ["RecipeError", "ResumeError", "UntrustedRecipeError"]


class ResumeError(RavexError):
    """The run cannot continue from its store: no checkpoint could be restored into the live
    objects, or a failed restore could not be undone. Raised out of the decorated function
    before the first training step; the objects hold no part of any checkpoint."""


class RecipeError(RavexError):
    """``ravex.load_model`` cannot rebuild the module from the checkpoint's recipe: there is none,
    it names something that is not a module class or factory, the code it names is missing or
    changed, or its weights do not fit what was built."""


class UntrustedRecipeError(RecipeError):
    """The recipe names code from a package the caller did not trust (``trust=``): nothing was imported."""

    exit_code = 7
