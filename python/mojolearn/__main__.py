"""python -m mojolearn info: version, binaries found, which would be used,
threads, and the CPU features the binary needs.
python -m mojolearn generate MODEL --prompt-ids 1,2,3 ...: generate tokens
(see mojolearn/_generate_cli.py, or --help).
python -m mojolearn serve MODEL ...: an OpenAI-compatible HTTP server
(mojolearn.serve; needs the `serve` extra)."""
import sys


def info() -> int:
    import mojolearn
    from . import _loader

    print(f"mojolearn {mojolearn.__version__}")
    print(f"python {sys.version.split()[0]}")
    print("library folders searched: " + ", ".join(str(d) for d in _loader.lib_dirs()))
    found = _loader.find_binaries()
    if not found:
        print("binaries found: none (install is incomplete; see README.md)")
        return 1
    print("binaries found:")
    for path in found:
        try:
            lib = _loader.native().Library(str(path))
            d = _loader.describe(lib)
            print(f"  {path.name}: vendor={d.get('vendor')} arch={d.get('arch')} "
                  f"mode={d.get('mode')} abi={lib.abi_version} "
                  f"needs CPU features: {d.get('features')}"
                  + ("" if d.get("vendor") == "cpu" else f" devices={lib.device_count}"))
        except Exception as e:  # report every binary, even a broken one
            print(f"  {path.name}: cannot load ({e})")
    for name, why in _loader.skipped_variants():
        print(f"skipped: {name} ({why})")
    try:
        target = _loader.requested_cpu_target()
    except ValueError as e:
        target = f"invalid: {e}"
    if target:
        print(f"MOJOLEARN_CPU_TARGET: {target}")
    try:
        lib = _loader.library()
        print(f"would use: {lib.path} (vendor {_loader.describe(lib).get('vendor')})")
    except Exception as e:
        print(f"would use: none ({e})")
        return 1
    print(f"threads: {_loader.get_num_threads()}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] == "info":
        return info()
    if argv[0] == "generate":
        from ._generate_cli import main as generate_main
        return generate_main(argv[1:])
    if argv[0] == "serve":
        from .serve.cli import main as serve_main
        return serve_main(argv[1:])
    print("usage: python -m mojolearn info | generate MODEL --prompt-ids 1,2,3 [...] | "
          "serve MODEL [...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
