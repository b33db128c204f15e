# Shared helper of the stubs in this folder (not a stand-in for anything itself).
# A stub name made here is a class that may appear in annotations, isinstance checks, tuple
# subscripts and base-class lists, as vLLM's module bodies use them, but that raises as soon as
# anything tries to use it (instantiate it, call it, read an attribute it does not have at the
# top level). So a code path under test that really needed torch, numpy, a GPU or MoRI fails
# loudly instead of running on a made-up answer: a stub can stop a test, never change its result.


class StubUsed(RuntimeError):
    """A stubbed-out dependency was used by the code under test."""


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise StubUsed(f"{cls.__qualname__} is a pdkv stub; the code path under test must not use it")

    def __or__(cls, other):
        # `torch.Tensor | None` in an annotation is evaluated when the function is defined.
        return cls

    def __ror__(cls, other):
        return cls

    def __getitem__(cls, item):
        # `np.ndarray[...]`-style subscripts in annotations.
        return cls


def placeholder(name):
    """A class named `name` that raises StubUsed when used (see the module comment)."""
    return _Meta(name, (), {"__qualname__": name, "__module__": "pdkv_stub"})


def module_getattr(module_name):
    """A module-level __getattr__ that hands out placeholders for every other name."""

    def __getattr__(name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return placeholder(f"{module_name}.{name}")

    return __getattr__
