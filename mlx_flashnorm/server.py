"""An OpenAI-compatible HTTP server: `python -m mlx_flashnorm.server`.

GET /v1/models, POST /v1/chat/completions and POST /v1/completions, plain or streamed as
server-sent events. Built on the standard library's ThreadingHTTPServer, as mlx-lm's server is:
each connection has a thread that reads and checks its request and writes the answer, while one
generation worker runs the model, taking requests from a queue one at a time, so requests that
arrive together never share a cache or interleave their steps (they wait their turn instead).
A client that goes away mid-stream cancels its request: the worker stops at the next token."""
import argparse
import json
import queue
import signal
import threading
import time
import uuid
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import mlx.core as mx

from .errors import UserError, run_cli
from .cli import add_model_args, add_sampling_args, wants_warmup
from .generate import context_length, load_from_args, make_sampler_for, stream_generate, warmup
from .lockstep import follow, lead, leads


class BadRequest(Exception):
    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


class Job:
    """One request for the worker: its tokens and sampling; the worker puts each Response on `out`,
    then None (or an exception)."""

    def __init__(self, tokens, max_tokens, seed, **sampling):
        self.tokens, self.max_tokens, self.seed, self.sampling = tokens, max_tokens, seed, sampling
        self.out = queue.Queue()
        self.cancelled = threading.Event()


def worker(model, tokenizer, jobs, warm, started):
    """The one thread that runs the model: MLX streams belong to their thread, so the model runs on
    the streams of this one (its arrays must be evaluated before: mx.eval(model.parameters())).
    warm: first play generate.warmup here (MLX keeps compiled functions per thread, so a warm-up
    on another thread would not serve this one); `started` then gets None, or the exception."""
    try:
        if warm:
            warmup(model)
    except Exception as e:
        return started.put(e)
    started.put(None)
    while True:
        job = jobs.get()
        if job.cancelled.is_set():
            continue
        try:
            with closing(lead(stream_generate, model, tokenizer, prompt=job.tokens,  # with the other ranks
                              max_tokens=job.max_tokens, seed=job.seed, **job.sampling)) as responses:
                for r in responses:
                    if job.cancelled.is_set():
                        break
                    job.out.put(r)
            job.out.put(None)
        except Exception as e:  # handed to the request's thread, which answers with an error
            job.out.put(e)
        mx.synchronize()  # the step queued ahead: work left pending on a thread's streams aborts at exit


def field(body, name, types, default, ok=lambda v: True, need=None):
    """body[name] if it has the right type and passes ok, default if absent or null."""
    value, types = body.get(name), types if isinstance(types, tuple) else (types,)
    if value is None:
        return default
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types or not ok(value):
        raise BadRequest(f"'{name}' must be {need}", name)
    return value


def message_text(content):
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest("a message's 'content' must be a string or a list of text parts", "messages")


def held_back(text, stops):
    """How many characters at the end of text might begin a stop string (not to be sent yet)."""
    return max((k for s in stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
               default=0)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, model, tokenizer, model_id, host="127.0.0.1", port=8080, max_tokens=256,
                 temp=0.0, top_p=1.0, top_k=0, warm=False):
        """max_tokens, temp, top_p: the defaults of requests that leave them out; top_k: for all.
        warm: warm the model up (generate.warmup) on the worker thread before serving."""
        super().__init__((host, port), Handler)
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.defaults = dict(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k)
        self.created = int(time.time())
        self.jobs = queue.Queue()
        mx.eval(model.parameters())  # lazy arrays evaluate on the thread that made them: this one
        started = queue.Queue()
        threading.Thread(target=worker, args=(model, tokenizer, self.jobs, warm, started), daemon=True).start()
        if (error := started.get()) is not None:
            self.server_close()
            raise error

    def job(self, body, chat):
        """Check a request body and turn it into a Job; BadRequest if anything is wrong."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        number = (int, float)
        field(body, "model", str, None, need="a string")
        field(body, "n", int, 1, lambda v: v == 1, "1 (one choice per request)")
        max_tokens = field(body, "max_tokens", int, None, lambda v: v >= 1, "a positive integer")
        if max_tokens is None:
            max_tokens = field(body, "max_completion_tokens", int, self.defaults["max_tokens"],
                               lambda v: v >= 1, "a positive integer")
        temp = field(body, "temperature", number, self.defaults["temp"], lambda v: v >= 0, "a number >= 0")
        top_p = field(body, "top_p", number, self.defaults["top_p"], lambda v: 0 < v <= 1,
                      "a number above 0 and at most 1")
        seed = field(body, "seed", int, None, need="an integer")
        stop = field(body, "stop", (str, list), [], lambda v: isinstance(v, str) or all(
            isinstance(s, str) and s for s in v), "a string or a list of non-empty strings")
        stream = field(body, "stream", bool, False, need="true or false")
        options = field(body, "stream_options", dict, {}, need="an object")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list of messages", "messages")
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
                raise BadRequest("each message must be an object with a 'role' string", "messages")
            messages = [{"role": m["role"], "content": message_text(m.get("content", ""))} for m in messages]
            if not self.tokenizer.has_chat_template:
                raise BadRequest("this model has no chat template: use /v1/completions")
            tokens = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest("'prompt' must be a non-empty string", "prompt")
            tokens = self.tokenizer.encode(prompt)
        ctx = context_length(self.model)
        if len(tokens) >= ctx:
            raise BadRequest(f"the prompt has {len(tokens)} tokens, the model's context is {ctx}",
                             "messages" if chat else "prompt")
        job = Job(tokens, max_tokens, seed, temp=temp, top_p=top_p, top_k=self.defaults["top_k"])
        job.stop = [stop] if isinstance(stop, str) else stop
        job.stream, job.usage_chunk = stream, options.get("include_usage") is True
        return job

    def run(self, job):
        """Queue job; yield (text, finish_reason, completion tokens) as it is generated, the text
        cut at the first stop string. Closing the generator early cancels the job."""
        self.jobs.put(job)
        text, sent, longest = "", 0, max(map(len, job.stop), default=0)
        try:
            while (r := job.out.get()) is not None:
                if isinstance(r, Exception):
                    raise r
                text += r.text
                finish, tokens = r.finish_reason, r.generation_tokens - (r.finish_reason == "stop")
                cuts = [i for i in (text.find(s, max(0, sent - longest)) for s in job.stop) if i >= 0]
                if cuts:
                    text, finish, tokens = text[:min(cuts)], "stop", r.generation_tokens
                end = len(text) if finish else len(text) - held_back(text, job.stop)
                yield text[sent:end], finish, tokens
                sent = end
                if finish:
                    return
        finally:
            job.cancelled.set()


class Handler(BaseHTTPRequestHandler):
    server: Server

    def send_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_error_json(self, status, message, param=None, kind="invalid_request_error"):
        self.send_json(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})

    def do_GET(self):
        if self.path.rstrip("/") != "/v1/models":
            return self.send_error_json(404, f"no such endpoint: GET {self.path}")
        model = {"id": self.server.model_id, "object": "model", "created": self.server.created,
                 "owned_by": "mlx-flashnorm"}
        self.send_json(200, {"object": "list", "data": [model]})

    def do_POST(self):
        chat = self.path.rstrip("/") == "/v1/chat/completions"
        if not chat and self.path.rstrip("/") != "/v1/completions":
            return self.send_error_json(404, f"no such endpoint: POST {self.path}")
        try:
            length = int(self.headers.get("Content-Length", 0))
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError:
                raise BadRequest("the request body is not valid JSON")
            job = self.server.job(body, chat)
        except BadRequest as e:
            return self.send_error_json(400, str(e), e.param)
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": self.server.model_id}
        pieces = self.server.run(job)
        try:
            if job.stream:
                self.stream(pieces, head, chat, job)
            else:
                self.answer(pieces, head, chat, job)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; closing `pieces` cancels its job
        except Exception as e:  # from the worker: nothing checked above should get here
            error = {"message": f"generation failed: {e}", "type": "server_error", "param": None, "code": None}
            if job.stream:  # the status line has gone out already
                self.wfile.write(f"data: {json.dumps({'error': error})}\n\n".encode())
            else:
                self.send_json(500, {"error": error})
        finally:
            pieces.close()

    def usage(self, job, tokens):
        return {"prompt_tokens": len(job.tokens), "completion_tokens": tokens,
                "total_tokens": len(job.tokens) + tokens}

    def answer(self, pieces, head, chat, job):
        text, finish, tokens = "", None, 0
        for piece, finish, tokens in pieces:
            text += piece
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        self.send_json(200, dict(head, choices=[choice], usage=self.usage(job, tokens)))

    def stream(self, pieces, head, chat, job):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        head = dict(head, object="chat.completion.chunk" if chat else "text_completion")

        def send(choices, **extra):
            self.wfile.write(f"data: {json.dumps(dict(head, choices=choices, **extra))}\n\n".encode())
            self.wfile.flush()

        def choice(text, finish, role=None):
            if not chat:
                return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            delta = {"role": role, "content": text} if role else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

        if chat:
            send([choice("", None, role="assistant")])
        tokens = 0
        for piece, finish, tokens in pieces:
            if piece or finish:
                send([choice(piece, finish)])
        if job.usage_chunk:
            send([], usage=self.usage(job, tokens))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_flashnorm.server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/models, "
                    "/v1/chat/completions, /v1/completions). The sampling flags set the defaults "
                    "of requests that leave them out.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    add_model_args(p)
    add_sampling_args(p)
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    make_sampler_for(args.temp, args.top_p, args.top_k)  # checks the sampling flags
    model, tokenizer = load_from_args(args, warm=False)  # the worker thread warms up
    if not leads():  # under mlx.launch: rank 0 serves, this rank computes its shard of each request
        if wants_warmup(args):
            warmup(model)
        return follow(stream_generate, model, tokenizer)
    model_id = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    try:
        server = Server(model, tokenizer, model_id, args.host, args.port, args.max_tokens, args.temp,
                        args.top_p, args.top_k, warm=wants_warmup(args))
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
    host, port = server.server_address[:2]
    # Ctrl-C stops the server even where the process started with SIGINT ignored (as a shell's
    # background job does), when Python installs no handler of its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"serving {model_id} on http://{host}:{port}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    run_cli(main)
