"""Knobs for experiments: a plain function, and a widget panel that calls it.

:func:`run_experiment` is the experiment every control panel runs: build ``num_requests`` requests
of a given prompt and output length, offer them at ``request_rate`` with at most
``max_concurrency`` in flight, to an engine sized by ``max_num_seqs``, ``max_num_batched_tokens``
and ``num_kv_blocks`` (the KV budget), or to a server at ``base_url``. Notebooks call it directly
— that is what runs in CI, where no widget callback ever fires — and :func:`control_panel` puts
the same arguments on sliders with a Run button for exploring by hand.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from minserve.lab.presets import Preset, get_preset

ENGINE_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks")


def run_experiment(preset: Preset | None = None, *, num_requests: int = 8,
                   request_rate: float = math.inf, max_concurrency: int | None = None,
                   prompt_tokens: int = 128, output_tokens: int = 32,
                   max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                   num_kv_blocks: int | None = None, base_url: str | None = None, seed: int = 0,
                   live: bool = True, name: str | None = None, **engine_args):
    """One experiment; returns a :class:`~minserve.lab.workload.RunResult`.

    Engine arguments left at None keep the preset's; ``engine_args`` are further engine arguments
    (e.g. ``enable_prefix_caching=False``). The engine comes from
    :func:`~minserve.lab.session.engine_for`, so the same arguments reuse the notebook's engine.
    With ``base_url`` the server's own settings apply: passing an engine argument then is an
    error (a client cannot resize a server). When the lab's target is a server
    (:mod:`minserve.lab.target`) and no ``base_url`` is given, the run goes there and the engine
    arguments asked for are named in one line and left to the server."""
    from minserve.lab.session import engine_for
    from minserve.lab.workload import make_requests, run_workload
    preset = preset or get_preset()
    knobs = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                 num_kv_blocks=num_kv_blocks, **engine_args)
    label = name or (f"{num_requests} x ({prompt_tokens} in, {output_tokens} out), rate "
                     f"{'inf' if math.isinf(request_rate) else request_rate}, concurrency "
                     f"{max_concurrency or 'no limit'}")
    from minserve.lab.target import current
    given = [k for k, v in knobs.items() if v is not None]
    if base_url is None and not current().in_process:
        # The lab's target is a server: the lab's own engine arguments are the server's to set.
        base_url = current().base_url
        if given:
            print(f"{', '.join(given)}: set by the server at {base_url} (not over HTTP); "
                  "this run uses the server's own engine arguments.")
        given = []
    if base_url is not None:
        if given:
            raise ValueError(f"{', '.join(given)} cannot be set over HTTP: the server at {base_url} "
                             "was started with its own engine arguments")
        from minserve.models.loader import load_tokenizer, resolve_model_dir
        tok = load_tokenizer(resolve_model_dir(preset.model))
        reqs = make_requests(tok, prompt_tokens, output_tokens, num_requests, seed=seed)
        return run_workload(base_url=base_url, requests=reqs, request_rate=request_rate,
                            max_concurrency=max_concurrency, seed=seed, live=live, name=label)
    llm = engine_for(preset, **knobs)
    reqs = make_requests(llm.get_tokenizer(), prompt_tokens, output_tokens, num_requests, seed=seed)
    return run_workload(llm, reqs, request_rate=request_rate, max_concurrency=max_concurrency,
                        seed=seed, live=live, name=label)


class ControlPanel:
    """The widgets, the function they call, and every result the Run button produced
    (``panel.results``, newest last)."""

    def __init__(self, widget, values: Callable[[], dict], run: Callable[..., Any]):
        self.widget, self.values, self.run = widget, values, run
        self.results: list = []

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)


def engine_settings(engine=None, preset: Preset | None = None, base_url: str | None = None) -> dict:
    """The values a panel's engine sliders show: the engine's own (``engine``: an LLM or
    LLMEngine, e.g. the one behind a notebook's local server), else for ``base_url`` what the
    server's ``/metrics`` tell (``vllm:cache_config_info`` carries the KV pool's size; the other
    knobs are None: unknown over HTTP), else the preset's."""
    if engine is not None:
        eng = getattr(engine, "llm_engine", engine)
        return {"max_num_seqs": int(eng.config.max_num_seqs),
                "max_num_batched_tokens": int(eng.config.max_num_batched_tokens),
                "num_kv_blocks": int(eng.kv.pool.num_blocks)}
    if base_url is not None:
        return {"max_num_seqs": None, "max_num_batched_tokens": None,
                "num_kv_blocks": _server_kv_blocks(base_url)}
    eng = (preset or get_preset()).engine_kwargs()
    return {"max_num_seqs": eng.get("max_num_seqs", 16),
            "max_num_batched_tokens": eng.get("max_num_batched_tokens", 512),
            "num_kv_blocks": eng.get("num_kv_blocks") or 256}


def _server_kv_blocks(base_url: str) -> int | None:
    import re

    from minserve.lab.target import headers_for
    try:
        import httpx
        text = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=5,
                         headers=headers_for(base_url) or {}).text
    except Exception:  # noqa: BLE001 - unknown is an answer
        return None
    m = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
    return int(m.group(1)) if m else None


def control_panel(run: Callable[..., Any] = run_experiment, preset: Preset | None = None,
                  base_url: str | None = None, engine_args: dict | None = None,
                  engine=None, **defaults) -> ControlPanel | None:
    """Sliders for :func:`run_experiment`'s arguments and a Run button that calls ``run`` with
    them (plus ``engine_args``, fixed engine arguments such as ``enable_prefix_caching=False``).
    ``defaults`` set the starting values of the workload sliders. The engine sliders start at the
    real engine's values (``engine``, or the server's at ``base_url``; see
    :func:`engine_settings`): over HTTP (``base_url``, or a lab whose target is a server) they
    are the server's and cannot be changed. The Run
    button's live figure and progress line redraw in the panel while it runs. Returns None (with a
    note) without ipywidgets."""
    try:
        import ipywidgets as w
    except ImportError:
        print("ipywidgets is not installed: call run_experiment(...) directly "
              "(pip install ipywidgets for the panel).")
        return None
    from minserve.lab.target import RemoteLLM, current
    preset = preset or get_preset()
    # The lab's target is a server: its sliders are the server's. ``run`` then finds the server
    # through the target (engine_for), so base_url is not passed to it unless the caller gave one.
    pass_url = base_url is not None
    if isinstance(engine, RemoteLLM):
        base_url, engine = base_url or engine.base_url, None
    elif base_url is None and engine is None and not current().in_process:
        base_url = current().base_url
    real = engine_settings(engine, preset, base_url)
    d = {"num_requests": 8, "request_rate": math.inf, "max_concurrency": None,
         "prompt_tokens": 128, "output_tokens": 32, **defaults}
    for k, v in real.items():
        d[k] = v if base_url is not None or engine is not None or k not in defaults else defaults[k]
    ctl = _controls(w, d)
    if base_url is not None:
        for k in ENGINE_KNOBS:
            if d[k] is None:   # unknown over HTTP: say so rather than show a made-up value
                ctl[k] = w.HTML(f"<code>{k}</code>: set by the server (not visible over HTTP)")
            else:
                ctl[k].disabled = True
                ctl[k].description += " (server's)"
    return _assemble(w, ctl, run, preset, base_url, engine_args, pass_url)


def _controls(w, d: dict) -> dict:
    style = {"description_width": "190px"}
    layout = w.Layout(width="460px")

    def dd(desc, options, value):
        if value not in [v for _, v in options]:
            options = options + [(str(value), value)]
        return w.Dropdown(description=desc, options=options, value=value, style=style, layout=layout)

    def slider(desc, value, lo, hi, step=1):
        value = lo if value is None else value
        return w.IntSlider(description=desc, value=value, min=min(lo, value), max=max(hi, value),
                           step=step, style=style, layout=layout)

    rates = [("all at once", math.inf)] + [(f"{r:g} req/s", float(r)) for r in (0.5, 1, 2, 4, 8, 16)]
    concs = [("no limit", None)] + [(str(c), c) for c in (1, 2, 4, 8, 16, 32)]
    return {
        "num_requests": slider("requests", d["num_requests"], 1, 128),
        "request_rate": dd("request rate", rates, d["request_rate"]),
        "max_concurrency": dd("max concurrency (client)", concs, d["max_concurrency"]),
        "prompt_tokens": slider("prompt tokens", d["prompt_tokens"], 8, 4096),
        "output_tokens": slider("output tokens", d["output_tokens"], 2, 512),
        "max_num_seqs": slider("max_num_seqs", d["max_num_seqs"], 1, 128),
        "max_num_batched_tokens": dd("max_num_batched_tokens",
                                     [(str(v), v) for v in (64, 128, 256, 512, 1024, 2048, 4096)],
                                     d["max_num_batched_tokens"] or 512),
        "num_kv_blocks": slider("KV budget (blocks)", d["num_kv_blocks"], 8, 4096),
    }


def _assemble(w, ctl: dict, run, preset, base_url, engine_args, pass_url: bool = True) -> ControlPanel:
    from IPython.display import display

    from minserve.lab.live import rendering_into
    button = w.Button(description="Run", button_style="primary", icon="play")
    bar_out, fig_out, out = w.Output(), w.Output(), w.Output()

    def values() -> dict:
        v = {k: c.value for k, c in ctl.items() if hasattr(c, "value") and not isinstance(c, w.HTML)}
        if base_url is not None:
            for k in ENGINE_KNOBS:
                v.pop(k, None)
            if pass_url:
                v["base_url"] = base_url
        else:
            v.update(engine_args or {})
        return v

    panel = ControlPanel(w.VBox([w.HTML("<b>Experiment</b>"), *ctl.values(), button, bar_out,
                                 fig_out, out]), values, run)

    def on_click(_):
        button.disabled = True
        try:
            for area in (bar_out, fig_out, out):
                area.clear_output()
            with rendering_into(fig_out, bar_out), out:
                result = run(preset, **values())
                panel.results.append(result)
                display(result.percentiles())
        finally:
            button.disabled = False

    panel.button = button
    button.on_click(on_click)
    return panel
