"""Out-of-bounds detection for Triton kernels under TRITON_INTERPRET=1: ``checked_memory()`` makes every load and
store of an interpreted kernel check that each address it touches (where its mask is set) lies in the storage of one
of the launch's tensor arguments, and raise ``OutOfBounds`` naming the kernel otherwise. The interpreter itself reads
and writes raw memory unchecked, so a kernel that strays past its tensors would go unnoticed on the CPU."""

import contextlib

import numpy as np


class OutOfBounds(AssertionError):
    pass


@contextlib.contextmanager
def checked_memory():
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    init, load, store = executor._init_args_hst, builder.create_masked_load, builder.create_masked_store
    launch = {"ranges": [], "kernel": None}

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        ranges = []
        for arg in list(args_hst) + list(kwargs_hst.values()):
            base = getattr(arg, "base", arg)  # a TensorWrapper's tensor
            if hasattr(base, "untyped_storage"):
                storage = base.untyped_storage()
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        launch["ranges"], launch["kernel"] = ranges, getattr(self.fn, "__name__", str(self.fn))
        return args_hst, kwargs_hst

    def check(ptrs, mask, itemsize, what):
        addresses = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))
        active = addresses[np.broadcast_to(mask.data, addresses.shape)].astype(np.uint64).ravel()
        inside = np.zeros(active.shape, dtype=bool)
        for lo, hi in launch["ranges"]:
            inside |= (active >= lo) & (active + itemsize <= hi)
        if not inside.all():
            raise OutOfBounds(f"{launch['kernel']}: {what} of {int((~inside).sum())} element(s) outside every "
                              f"tensor argument")

    def masked_load(self, ptrs, mask, other, *args):
        check(ptrs, mask, np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize, "a load")
        return load(self, ptrs, mask, other, *args)

    def masked_store(self, ptrs, value, mask, *args):
        check(ptrs, mask, np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize, "a store")
        return store(self, ptrs, value, mask, *args)

    executor._init_args_hst, builder.create_masked_load, builder.create_masked_store = \
        init_args, masked_load, masked_store
    try:
        yield
    finally:
        executor._init_args_hst, builder.create_masked_load, builder.create_masked_store = init, load, store
