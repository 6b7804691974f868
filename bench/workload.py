"""Many-adapter traffic as multi-tenant operators see it: which adapter each request names (a popularity law over N
adapters), when it arrives (Poisson, bursty Gamma, or a fixed number of clients), how long its prompt and answer are;
and a client that sends it to an OpenAI-compatible server and times every request. Pure Python, no vLLM.

Popularity: `uniform`; `zipf:ALPHA` (the k-th most popular adapter gets a share proportional to k^-ALPHA, as in
Chameleon and Predictive-LoRA; ALPHA 1.0 is the issue's setting); `distinct` (every request a different adapter, in a
shuffled order that repeats only after all N, the BD-LoRA paper's F.4 setting); `single` (every request the most
popular adapter: the one-adapter server at the same rate). Arrivals: `poisson:RATE` (requests/s), `gamma:RATE:CV`
(bursty; CV 4 is S-LoRA's burstiest), `concurrency:C` (C clients, each sending its next request when the last ended).
Lengths: `fixed:IN/OUT` or `chat` (log-normal, median 256 in / 128 out, clipped to 16-2048 / 8-512).

Popularity tiers (for the per-tier percentiles): adapters by rank, `head` up to half of the expected requests, `torso`
up to 90%, `tail` the rest.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    send_at: float  # seconds from the start (open loop); 0 for closed-loop clients
    adapter: int  # popularity rank, 0 the most popular; -1 the base model
    input_len: int
    output_len: int


@dataclass
class Timing:
    index: int
    adapter: str
    rank: int
    tier: str
    input_len: int
    output_len: int
    sent: float = 0.0
    ttft: float = math.nan
    tpot: float = math.nan
    e2e: float = math.nan
    tokens: int = 0
    status: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.tokens > 0


def popularity_weights(law: str, n: int) -> list[float]:
    if law in ("uniform", "distinct"):
        return [1.0 / n] * n
    if law == "single":
        return [1.0] + [0.0] * (n - 1)
    kind, _, alpha = law.partition(":")
    if kind != "zipf" or not alpha:
        raise ValueError(f"unknown popularity {law!r}: uniform, zipf:ALPHA, distinct or single")
    weights = [(k + 1) ** -float(alpha) for k in range(n)]
    total = sum(weights)
    return [w / total for w in weights]


def tiers(weights: list[float]) -> list[str]:
    """head / torso / tail of each popularity rank (see the module's docstring)."""
    out, cumulative = [], 0.0
    for w in weights:
        out.append("head" if cumulative < 0.5 else "torso" if cumulative < 0.9 else "tail")
        cumulative += w
    return out


def lengths(spec: str, rng: random.Random) -> tuple[int, int]:
    if spec.startswith("fixed:"):
        a, b = spec.removeprefix("fixed:").split("/")
        return int(a), int(b)
    if spec == "chat":

        def lognormal(median, low, high):
            return int(min(high, max(low, rng.lognormvariate(math.log(median), 0.8))))

        return lognormal(256, 16, 2048), lognormal(128, 8, 512)
    raise ValueError(f"unknown lengths {spec!r}: fixed:IN/OUT or chat")


def plan(popularity: str, arrivals: str, length_spec: str, adapters: int, requests: int, seed: int = 0):
    """The requests of one run, in sending order."""
    rng = random.Random(seed)
    weights = popularity_weights(popularity, adapters)
    order = list(range(adapters))
    rng.shuffle(order)
    kind, _, rest = arrivals.partition(":")
    clock, planned = 0.0, []
    for i in range(requests):
        if popularity == "distinct":
            adapter = order[i % adapters]
        else:
            adapter = rng.choices(range(adapters), weights)[0]
        if kind == "poisson":
            clock += rng.expovariate(float(rest))
        elif kind == "gamma":
            rate, cv = map(float, rest.split(":"))
            shape = 1.0 / (cv * cv)
            clock += rng.gammavariate(shape, 1.0 / (rate * shape))
        elif kind != "concurrency":
            raise ValueError(f"unknown arrivals {arrivals!r}: poisson:RATE, gamma:RATE:CV or concurrency:C")
        planned.append(PlannedRequest(i, clock if kind != "concurrency" else 0.0, adapter, *lengths(length_spec, rng)))
    return planned, tiers(weights)


def prompt(input_len: int, rng: random.Random, vocab: int) -> str:
    """`input_len` words of the benchmark models' word-level tokenizer (each one token; bench/shapes.py)."""
    return " ".join(f"w{rng.randrange(4, vocab)}" for _ in range(input_len))


async def send(http, url: str, model: str, text: str, max_tokens: int, timing: Timing, api_key: str | None):
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    timing.sent = time.time()
    first = last = None
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            timing.status = response.status
            if response.status != 200:
                timing.error = (await response.text())[:300]
                return
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                if chunk.get("usage"):
                    timing.tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a refused connection, a reset: the request failed, the run goes on
        timing.status, timing.error = timing.status or -1, repr(e)[:300]
        return
    if first is not None:
        timing.ttft = first - start
        timing.e2e = last - start
        if timing.tokens > 1:
            timing.tpot = (last - first) / (timing.tokens - 1)


async def run(url: str, names: list[str], planned: list[PlannedRequest], tier_of: list[str], arrivals: str,
              vocab: int, api_key: str | None = None, base_model: str | None = None, seed: int = 0,
              timeout_s: float = 600) -> tuple[list[Timing], float]:  # fmt: skip
    """Send `planned` (adapter rank k names `names[k]`); returns every request's timing and the run's seconds."""
    import aiohttp

    rng = random.Random(seed + 1)
    texts = [prompt(p.input_len, rng, vocab) for p in planned]
    timings = [
        Timing(p.index, names[p.adapter] if p.adapter >= 0 else (base_model or "base"), p.adapter,
               tier_of[p.adapter] if p.adapter >= 0 else "base", p.input_len, p.output_len)
        for p in planned
    ]  # fmt: skip
    connector = aiohttp.TCPConnector(limit=0)
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as http:
        if arrivals.startswith("concurrency:"):
            queue = iter(range(len(planned)))

            async def client():
                for i in queue:
                    await send(http, url, timings[i].adapter, texts[i], planned[i].output_len, timings[i], api_key)

            await asyncio.gather(*(client() for _ in range(int(arrivals.split(":")[1]))))
        else:

            async def at(i):
                await asyncio.sleep(max(0.0, planned[i].send_at - (time.perf_counter() - started)))
                await send(http, url, timings[i].adapter, texts[i], planned[i].output_len, timings[i], api_key)

            await asyncio.gather(*(at(i) for i in range(len(planned))))
    return timings, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    position = (len(values) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return values[low] + (values[high] - values[low]) * (position - low)


def summarise(timings: list[Timing], seconds: float, ttft_slo_s: float) -> dict:
    """Throughput, goodput at the TTFT SLO, and TTFT/TPOT p50/p99 overall and per popularity tier."""
    ok = [t for t in timings if t.ok]
    out = {
        "requests": len(timings), "completed": len(ok), "failed": len(timings) - len(ok), "seconds": round(seconds, 3),
        "requests_per_s": len(ok) / seconds if seconds else 0.0,
        "output_tokens_per_s": sum(t.tokens for t in ok) / seconds if seconds else 0.0,
        "goodput_per_s": sum(t.ttft <= ttft_slo_s for t in ok) / seconds if seconds else 0.0,
        "ttft_slo_s": ttft_slo_s,
    }  # fmt: skip
    for scope, members in [("all", ok)] + [(tier, [t for t in ok if t.tier == tier]) for tier in
                                           ("head", "torso", "tail")]:  # fmt: skip
        for metric in ("ttft", "tpot"):
            for q in (0.5, 0.99):
                out[f"{scope}_{metric}_p{int(q * 100)}_ms"] = percentile([getattr(t, metric) for t in members], q) * 1e3
        out[f"{scope}_requests"] = len(members)
    errors = sorted({t.error[:120] for t in timings if not t.ok and t.error})
    out["error_examples"] = errors[:3]
    return out


def timings_rows(timings: list[Timing]) -> list[dict]:
    return [asdict(t) for t in timings]
