"""Speed for Triton's interpreter, which runs the kernel tests on CPU-only machines: `speed_up_interpreter`
(tests/conftest.py applies it; scripts that tests start in a subprocess call it themselves) removes
work whose result the interpreter throws away or recomputes, so kernels compute exactly what they
compute without it (tests/test_triton_interpreter.py). Each part leaves a Triton whose interpreter
has another shape as it is, and applying one twice changes nothing: each replacement keeps the function
it replaces as `__wrapped__`."""

import dataclasses
import inspect


def speed_up_interpreter():
    """All of this module's speed-ups."""
    patch_language_once_per_launch()
    skip_discarded_overflow_checks()
    memoize_type_conversions()
    share_tensor_shapes()
    skip_equal_shape_broadcasts()


def patch_language_once_per_launch():
    """Triton's interpreter swaps triton.language's functions for interpreted ones when a kernel
    launches (undoing it when the launch ends), and again on every call of a @triton.jit helper
    inside the kernel, walking the whole module each time (inspect.getmembers) for every program
    of the grid: most of the time of a kernel built from helpers. Here a helper's call skips the
    walk when the launch has swapped its modules already; the swap is idempotent, so kernels
    compute the same. A helper that sees a module the kernel does not (triton.language.core, say)
    is patched as Triton patches it."""
    from triton import language
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or hasattr(patch_lang, "__wrapped__") or not hasattr(interpreter, "_LangPatchScope"):
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

    patch_once.__wrapped__ = patch_lang
    interpreter._patch_lang = patch_once


def skip_discarded_overflow_checks():
    """With its `sanitize_overflow` option on (the interpreter's default), Triton's front end follows
    every int32 add, sub and mul by two casts to int64, the operation in int64 and two comparisons
    with int32's range, and hands the result to `device_assert`, which returns without looking at it
    unless the `debug` option is on (the interpreter's options keep it off). The check multiplies
    the work of integer index arithmetic and checks nothing, so here it is off while `debug` is off."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not getattr(options, "sanitize_overflow", False):
        return
    if getattr(options, "debug", True):
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


def memoize_type_conversions():
    """Two pure functions of a type that the interpreter calls on every operation of every program:
    the numpy dtype of a Triton type (`_get_np_dtype` builds a table of 17 numpy dtypes on each call)
    and a block type's shape, size and name (`block_type.__init__` unwraps and validates the shape on
    each construction). Each is computed once per distinct argument (per scalar type; per element
    type's name and shape) and reused."""
    from triton.language import core
    from triton.runtime import interpreter

    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None and not hasattr(np_dtype, "__wrapped__"):
        of_scalar: dict = {}  # scalar type (hashed and compared by name, as Triton's table is) -> numpy dtype

        def get_np_dtype(tt_dtype):
            scalar = tt_dtype.element_ty if isinstance(tt_dtype, core.block_type) else tt_dtype
            if isinstance(scalar, core.pointer_type):  # Triton's first test: no table built
                return np_dtype(scalar)
            if scalar not in of_scalar:
                of_scalar[scalar] = np_dtype(scalar)
            return of_scalar[scalar]

        get_np_dtype.__wrapped__ = np_dtype
        interpreter._get_np_dtype = get_np_dtype

    init = core.block_type.__init__
    if hasattr(init, "__wrapped__") or list(inspect.signature(init).parameters) != ["self", "element_ty", "shape"]:
        return
    known: dict = {}  # (str(element type), shape as given) -> (shape, numel, name)

    def block_type_init(self, element_ty, shape):
        try:
            key = (str(element_ty), tuple(shape))
            shape_numel_name = known.get(key)
        except TypeError:  # a shape that is no sequence, or an unhashable part: construct as Triton does
            key = shape_numel_name = None
        if shape_numel_name is None:
            init(self, element_ty, shape)
            if key is not None:
                known[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = shape_numel_name

    block_type_init.__wrapped__ = init
    core.block_type.__init__ = block_type_init


def share_tensor_shapes():
    """A Triton tensor's `shape` is a Triton tuple of constexpr wrappers of its type's shape and `numel`
    a constexpr of their product, rebuilt by `tensor.__init__` for every value that every operation
    of every program makes. Here tensors of one type share one such tuple and one `numel` (constexprs
    are values that no operation changes), built on the type's first tensor and found by the block
    type's name (its shape and element type; a scalar's are ()), a string: Triton's tuples compare
    slowly as dict keys. The other attributes are set as Triton sets them."""
    from triton.language import core

    init = core.tensor.__init__
    if hasattr(init, "__wrapped__") or list(inspect.signature(init).parameters) != ["self", "handle", "type"]:
        return
    by_type: dict = {}  # a block type's name, or None for a scalar type -> (shape, numel)

    def tensor_init(self, handle, type):
        key = type.name if type.is_block() else None
        shared = by_type.get(key)
        if shared is None:
            init(self, handle, type)
            by_type[key] = (self.shape, self.numel)
            return
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.shape, self.numel = shared

    tensor_init.__wrapped__ = init
    core.tensor.__init__ = tensor_init


def skip_equal_shape_broadcasts():
    """Every binary operation first makes its operands' shapes compatible (`broadcast_impl_value`),
    comparing the shapes dimension by dimension as Triton tuples, which wrap each comparison in a
    constexpr, and returns the operands unchanged when two blocks have one shape. Here the
    interpreter's semantic answers that case after one comparison of the plain shape lists; every
    other case (a scalar, other shapes) goes to Triton's own."""
    from triton.runtime import interpreter

    semantic = getattr(interpreter, "interpreter_semantic", None)
    broadcast = getattr(semantic, "broadcast_impl_value", None)
    if broadcast is None or hasattr(broadcast, "__wrapped__"):
        return

    def broadcast_impl_value(lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        if lhs_ty.is_block() and rhs_ty.is_block() and (
                lhs_ty.shape is rhs_ty.shape or list(lhs_ty.shape) == list(rhs_ty.shape)):
            return lhs, rhs
        return broadcast(lhs, rhs)

    broadcast_impl_value.__wrapped__ = broadcast
    semantic.broadcast_impl_value = broadcast_impl_value
