"""The worker process behind the ``openvino`` engine's ``genai`` backend: it holds one
OpenVINO GenAI ``ContinuousBatchingPipeline`` and decodes token ids on request.

Why a process: a native call that never returns cannot be interrupted from Python, but
a process can be killed.  The driver (:class:`~sprpo_lib.agent.engines.openvino.PipelineWorker`)
waits for every reply with a deadline; past it, it kills this process, starts a new one
and repeats the call with the same seeds.

Two precautions remove the known cause of such hangs.  GenAI's stop-string matching
(``match_stop_string``) detokenizes from the sampler's worker threads, and the
detokenizer's request queue (``CircularBufferQueue``: a free-slot check under one mutex,
the waiter queued under another) can lose a wake-up when two threads use it at once, or
when a tokenizer's asynchronous warm-up hands its request back meanwhile.  So every
pipeline here samples on one thread (``sampler_num_threads=1``, as GenAI's own
``LLMPipeline`` adapter does), and one ``Tokenizer`` per worker, warmed up once, serves
every pipeline the worker builds, first used by a generate call long after its warm-up.
On ``SIGUSR1`` the worker prints every thread's Python stack to stderr (the driver asks
for it before killing a stalled worker).

It ends itself when its driver (``argv[2]``, a process id) is gone.  Protocol: JSON
messages on the socket whose descriptor is ``argv[1]``
(``multiprocessing.connection`` framing); every reply carries ``ok`` and ``cpu_s`` (this
process's CPU seconds so far), a failure ``error`` and ``kind``.

* ``{"op": "build", "path", "tokenizer", "scheduler": {...}, "properties": {...}}``:
  a pipeline on the IR folder ``path`` (``tokenizer``: the folder of the tokenizer IRs).
* ``{"op": "generate", "ids": [[int]], "configs": [{...}], "stall_s": float}``:
  ``{"ids": [[int]]}``, the generated ids per prompt.  ``stall_s`` (fault injection for
  tests and the churn benchmark) sleeps that long first, as a hung call would.
* ``{"op": "exit"}``.

It imports neither torch nor the rest of the library (run as a script: it starts in
about half a second).
"""
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import numpy as np

SET_FIELDS = ("stop_token_ids", "stop_strings")  # GenerationConfig fields that take a set


def generation_config(og, fields: dict):
    """An ``openvino_genai.GenerationConfig`` with these fields set."""
    g = og.GenerationConfig()
    for k, v in fields.items():
        setattr(g, k, set(v) if k in SET_FIELDS else v)
    return g


class Server:
    """One pipeline and its tokenizer, built on request."""

    def __init__(self):
        import openvino_genai  # optional engine: loaded on use

        self.og = openvino_genai
        self.pipe = None
        self.tokenizer = None
        self.tokenizer_path = None

    def build(self, msg: dict) -> dict:
        og = self.og
        t0 = time.perf_counter()
        self.pipe = None  # the old pipeline's memory goes first
        if self.tokenizer is None or self.tokenizer_path != msg["tokenizer"]:
            # no decode here: a decode racing the asynchronous warm-up's hand-back is the lost
            # wake-up itself; compiling the pipeline below outlasts the warm-up by far
            self.tokenizer = og.Tokenizer(msg["tokenizer"])
            self.tokenizer_path = msg["tokenizer"]
        sched = og.SchedulerConfig()
        for k, v in msg["scheduler"].items():
            setattr(sched, k, v)
        props = dict(msg["properties"], sampler_num_threads=1)
        self.pipe = og.ContinuousBatchingPipeline(msg["path"], self.tokenizer, sched, "CPU", **props)
        return {"load_s": round(time.perf_counter() - t0, 3)}

    def generate(self, msg: dict) -> dict:
        import openvino as ov  # optional engine: loaded on use

        if msg.get("stall_s"):
            time.sleep(float(msg["stall_s"]))
        if self.pipe is None:
            raise RuntimeError("generate before build")
        ids = msg["ids"]
        if not ids:
            return {"ids": []}
        configs = [generation_config(self.og, c) for c in msg["configs"]]
        results = self.pipe.generate([ov.Tensor(np.array([p], dtype=np.int64)) for p in ids], configs)
        return {"ids": [[int(t) for t in r.m_generation_ids[0]] for r in results]}


def watch_parent(ppid: int) -> None:
    """End this process when the driver is gone (killed, or ended by a test deadline): a
    worker stuck in native code would otherwise hold its memory and the driver's output
    pipes for ever.  GenAI releases the GIL while it generates, so this thread runs."""
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(3)


def main(fd: int, ppid: int) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=watch_parent, args=(ppid,), daemon=True).start()
    conn = Connection(fd)
    server = None
    while True:
        try:
            msg = json.loads(conn.recv_bytes())
        except EOFError:  # the driver is gone
            return
        if msg.get("op") == "exit":
            return
        try:
            server = server or Server()
            if msg["op"] == "build":
                reply = server.build(msg)
            elif msg["op"] == "generate":
                reply = server.generate(msg)
            else:
                raise ValueError(f"unknown op {msg.get('op')!r}")
            reply["ok"] = True
        except Exception as e:  # noqa: BLE001 - every failure goes back to the driver, which raises it
            reply = {"ok": False, "kind": type(e).__name__, "error": str(e),
                     "traceback": traceback.format_exc(limit=4)}
        reply["cpu_s"] = round(time.process_time(), 3)
        conn.send_bytes(json.dumps(reply).encode())


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
