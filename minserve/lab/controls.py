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
    error (a client cannot resize a server)."""
    from minserve.lab.session import engine_for
    from minserve.lab.workload import make_requests, run_workload
    preset = preset or get_preset()
    knobs = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                 num_kv_blocks=num_kv_blocks, **engine_args)
    label = name or (f"{num_requests} x ({prompt_tokens} in, {output_tokens} out), rate "
                     f"{'inf' if math.isinf(request_rate) else request_rate}, concurrency "
                     f"{max_concurrency or 'no limit'}")
    if base_url is not None:
        given = [k for k, v in knobs.items() if v is not None]
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


def control_panel(run: Callable[..., Any] = run_experiment, preset: Preset | None = None,
                  base_url: str | None = None, engine_args: dict | None = None,
                  **defaults) -> ControlPanel | None:
    """Sliders for :func:`run_experiment`'s arguments and a Run button that calls ``run`` with
    them (plus ``engine_args``, fixed engine arguments such as ``enable_prefix_caching=False``).
    ``defaults`` set the starting values. Returns None (with a note) without ipywidgets."""
    try:
        import ipywidgets as w
    except ImportError:
        print("ipywidgets is not installed: call run_experiment(...) directly "
              "(pip install ipywidgets for the panel).")
        return None
    from IPython.display import display
    preset = preset or get_preset()
    eng = preset.engine_kwargs()
    d = {"num_requests": 8, "request_rate": math.inf, "max_concurrency": None,
         "prompt_tokens": 128, "output_tokens": 32,
         "max_num_seqs": eng.get("max_num_seqs", 16),
         "max_num_batched_tokens": eng.get("max_num_batched_tokens", 512),
         "num_kv_blocks": eng.get("num_kv_blocks") or 256, **defaults}
    style = {"description_width": "190px"}
    layout = w.Layout(width="460px")

    def dd(desc, options, value):
        if value not in [v for _, v in options]:
            options = options + [(str(value), value)]
        return w.Dropdown(description=desc, options=options, value=value, style=style, layout=layout)

    rates = [("all at once", math.inf)] + [(f"{r:g} req/s", float(r)) for r in (0.5, 1, 2, 4, 8, 16)]
    concs = [("no limit", None)] + [(str(c), c) for c in (1, 2, 4, 8, 16, 32)]
    ctl = {
        "num_requests": w.IntSlider(description="requests", value=d["num_requests"], min=1, max=128,
                                    style=style, layout=layout),
        "request_rate": dd("request rate", rates, d["request_rate"]),
        "max_concurrency": dd("max concurrency (client)", concs, d["max_concurrency"]),
        "prompt_tokens": w.IntSlider(description="prompt tokens", value=d["prompt_tokens"], min=8,
                                     max=4096, step=8, style=style, layout=layout),
        "output_tokens": w.IntSlider(description="output tokens", value=d["output_tokens"], min=2,
                                     max=512, style=style, layout=layout),
        "max_num_seqs": w.IntSlider(description="max_num_seqs", value=d["max_num_seqs"], min=1,
                                    max=128, style=style, layout=layout),
        "max_num_batched_tokens": dd("max_num_batched_tokens",
                                     [(str(v), v) for v in (64, 128, 256, 512, 1024, 2048, 4096)],
                                     d["max_num_batched_tokens"]),
        "num_kv_blocks": w.IntSlider(description="KV budget (blocks)", value=d["num_kv_blocks"],
                                     min=8, max=4096, step=8, style=style, layout=layout),
    }
    if base_url is not None:
        for k in ENGINE_KNOBS:
            ctl[k].disabled = True
            ctl[k].description += " (server's)"
    button = w.Button(description="Run", button_style="primary", icon="play")
    out = w.Output()

    def values() -> dict:
        v = {k: c.value for k, c in ctl.items()}
        if base_url is not None:
            for k in ENGINE_KNOBS:
                v.pop(k)
            v["base_url"] = base_url
        else:
            v.update(engine_args or {})
        return v

    panel = ControlPanel(w.VBox([w.HTML("<b>Experiment</b>"), *ctl.values(), button, out]), values, run)

    def on_click(_):
        button.disabled = True
        try:
            with out:
                out.clear_output()
                result = run(preset, **values())
                panel.results.append(result)
                display(result.percentiles())
        finally:
            button.disabled = False

    button.on_click(on_click)
    return panel
