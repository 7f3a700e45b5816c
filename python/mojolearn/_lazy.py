"""Package exports that load on first use (a module ``__getattr__``, PEP 562).

``import mojolearn`` (and its subpackages) imports no kernel binary, NumPy
or PyTorch: each package names what it exports and the module that defines
it, and that module is imported the first time the name is read.
"""
import sys
from importlib import import_module


def lazy_getattr(package: str, table: dict):
    """The module ``__getattr__`` of ``package`` for the exports in ``table``.

    Parameters
    ----------
    package : str
        The package's ``__name__``.
    table : dict of str to str or None
        Export name -> the module that defines it (relative to ``package``,
        or absolute); None: the export is the package's submodule of that
        name.

    Returns
    -------
    callable
        ``__getattr__(name)``: the export, imported on first read and then
        cached in the package (later reads do not call it); AttributeError
        for a name not in ``table``. Concurrent first reads import once
        (the import lock) and store the same object.
    """
    def __getattr__(name):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where = table[name]
        if where is None:
            value = import_module(f".{name}", package)
        else:
            value = getattr(import_module(where, package), name)
        setattr(sys.modules[package], name, value)
        return value
    return __getattr__
