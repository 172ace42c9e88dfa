"""Speed for Triton's interpreter, which runs the kernel tests on CPU-only machines (tests/conftest.py
applies it; scripts that tests start in a subprocess call it themselves)."""


def patch_language_once_per_launch():
    """Triton's interpreter swaps triton.language's functions for interpreted ones when a kernel
    launches (undoing it when the launch ends), and again on every call of a @triton.jit helper
    inside the kernel, walking the whole module each time (inspect.getmembers) for every program
    of the grid: most of the time of a kernel built from helpers. Here a helper's call skips the
    walk when the launch has swapped its modules already; the swap is idempotent, so kernels
    compute the same. A helper that sees a module the kernel does not (triton.language.core, say)
    is patched as Triton patches it. A Triton whose interpreter has another shape keeps its own."""
    from triton import language
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    languages = (language, language.core)
    modules_of: dict = {}  # function -> ids of the language modules its globals hold
    swapped: set[int] = set()  # those the launch in progress has swapped; empty between launches

    def patch_once(fn):
        if fn not in modules_of:
            modules_of[fn] = {id(value) for value in fn.__globals__.values() if any(value is m for m in languages)}
        modules = modules_of[fn]
        in_launch = bool(swapped)  # every kernel's globals hold a language module (Triton asserts it)
        if in_launch and modules <= swapped:
            return interpreter._LangPatchScope()  # nothing to undo
        scope = patch_lang(fn)
        swapped.update(modules)
        if in_launch:  # a helper's own module: Triton leaves its scope to no one, and so does this
            return scope
        restore = scope.restore

        def restore_and_end_launch():
            swapped.clear()
            restore()

        scope.restore = restore_and_end_launch
        return scope

    interpreter._patch_lang = patch_once
