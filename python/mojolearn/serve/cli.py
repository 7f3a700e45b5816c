"""python -m mojolearn serve MODEL ...: the OpenAI-compatible server on
uvicorn. SIGTERM (or Ctrl-C) stops taking connections, lets the requests in
flight finish and exits 0. Errors before serving are one line on stderr and
exit status 2 (--debug: the traceback)."""
from __future__ import annotations

import argparse
import logging
import sys

from .. import lowbit
from .._cli_common import load_tokenizer, model_folder, report_errors

PROG = "python -m mojolearn serve"


def _parser():
    ap = argparse.ArgumentParser(prog=PROG, description="Serve a Mamba model over an "
                                 "OpenAI-compatible HTTP API.")
    ap.add_argument("model", help="a checkpoint folder or a Hub id org/name")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model-name", default=None,
                    help="the id clients name (default: the folder's name or the Hub id)")
    ap.add_argument("--weight-format", default=None, choices=list(lowbit.FORMATS),
                    help="format the weights are kept in (default: as the checkpoint "
                         "stores them)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-rows", type=int, default=16, help="requests decoded at once")
    ap.add_argument("--max-queue", type=int, default=64,
                    help="requests waiting for a row; beyond, 503 with Retry-After")
    ap.add_argument("--max-prompt-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=1024, help="tokens generated per request")
    ap.add_argument("--prefill-chunk", type=_chunk, default="auto",
                    help="prompt tokens prefilled per step, so that a long prompt does not "
                    "stall the running streams ('auto': sized as the engine runs so that a "
                    "step's prefill takes about 1.5x its decode; 0: each prompt whole)")
    ap.add_argument("--prefix-cache-mb", type=float, default=256,
                    help="MiB of prefix states kept for reuse (0: no cache)")
    ap.add_argument("--download", action="store_true",
                    help="download a Hub id missing from the cache")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    return ap


def main(argv) -> int:
    args = _parser().parse_args(argv)
    return report_errors(lambda: _run(args), prog=PROG, debug=args.debug)


def _draining_server_class():
    import contextlib
    import signal
    import threading
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's Server, except that a SIGTERM or SIGINT only stops it
        (in-flight requests finish) and is not raised again afterwards, so
        the process exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

    return DrainingServer


def _chunk(text: str):
    """--prefill-chunk: 'auto' or an int (checked by _check)."""
    return text if text == "auto" else int(text)


def _check(args):
    if args.prefill_chunk != "auto" and args.prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk must be 'auto' or >= 0, got {args.prefill_chunk}")
    for name in ("max_rows", "max_queue", "max_prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be from 0 to 65535, got {args.port}")
    if not args.prefix_cache_mb >= 0:
        raise ValueError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    _check_address(args.host, args.port)


def _check_address(host, port):
    """Bind once before the model loads, so a taken port fails at once."""
    import socket
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _run(args) -> int:
    _check(args)
    try:
        import uvicorn
        from .app import Server
    except ImportError as e:
        raise ImportError(f"serving needs the serve extra: pip install 'mojolearn[serve]' "
                          f"({e})") from None
    import mojolearn
    from pathlib import Path
    from .chat import load_chat_template
    from .schemas import Limits
    if args.debug:  # SIGUSR1 prints every thread's stack (a stuck server)
        import faulthandler
        import signal
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads is not None:
        mojolearn.set_num_threads(args.threads)
    folder = model_folder(args.model, download=args.download)
    tok = load_tokenizer(folder)
    lm = mojolearn.MambaLM(folder, weight_format=args.weight_format)
    name = args.model_name or (Path(args.model).name if Path(args.model).is_dir()
                               else args.model)
    limits = Limits(max_rows=args.max_rows, max_queue=args.max_queue,
                    max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens)
    server = Server(lm, tokenizer=tok, chat_template=load_chat_template(folder),
                    model_name=name, limits=limits,
                    batcher_options={"prefill_chunk": args.prefill_chunk or None,
                                     "prefix_cache_bytes": int(args.prefix_cache_mb * 2**20)})
    log = logging.getLogger("mojolearn.serve")
    log.info("serving %s as %r on http://%s:%d (chat: %s)", lm, name, args.host, args.port,
             "yes" if server.chat_template is not None else "no template")
    config = uvicorn.Config(server.app(), host=args.host, port=args.port, access_log=False,
                            log_level="warning" if args.log_level != "debug" else "debug",
                            lifespan="on", timeout_keep_alive=5)
    _draining_server_class()(config).run()  # SIGTERM/SIGINT: stop accepting, drain, then return
    server.close()
    log.info("stopped")
    return 0
