"""A live session in a notebook (the pagevis[notebook] extra: anywidget): step, play and pause, choose the layer
and the policy; the view is the HTML export's (pagevis.export.html.render_view), redrawn after every step.

Playing needs no thread: while it plays, the browser asks for the next step (a "step" message) each time the
last one is drawn, and the kernel steps the session between cells' work. Where widgets do not render (an
exported notebook, GitHub), the output's text/html is the static view of the session as it was."""

from __future__ import annotations

try:
    import anywidget
    import traitlets
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("Session.widget() needs the pagevis[notebook] extra: pip install 'pagevis[notebook]' "
                      "(anywidget)") from error

from pagevis.errors import ConfigError

ESM = r"""
function render({ model, el }) {
  const bar = document.createElement("div");
  bar.style.cssText = "display:flex;gap:8px;align-items:center;padding:6px 0;font:13px system-ui,sans-serif";
  const button = (label) => { const b = document.createElement("button"); b.textContent = label; bar.appendChild(b);
    return b; };
  const step = button("Step"), play = button("Play");
  const layerLabel = document.createElement("label"); layerLabel.textContent = "layer ";
  const layer = document.createElement("input"); layer.type = "number"; layer.min = 0; layer.style.width = "4em";
  layerLabel.appendChild(layer); bar.appendChild(layerLabel);
  const policyLabel = document.createElement("label"); policyLabel.textContent = "policy ";
  const policy = document.createElement("select"); policyLabel.appendChild(policy); bar.appendChild(policyLabel);
  const status = document.createElement("span"); status.style.opacity = "0.7"; bar.appendChild(status);
  const view = document.createElement("div");
  el.appendChild(bar); el.appendChild(view);

  function draw() {
    view.innerHTML = model.get("html");
    // innerHTML does not run scripts: run the view's own (the HTML export's) as a new script element
    view.querySelectorAll("script:not([type])").forEach((old) => {
      const s = document.createElement("script"); s.textContent = old.textContent; old.replaceWith(s);
    });
    layer.max = model.get("layers") - 1; layer.value = model.get("layer");
    policy.innerHTML = model.get("policies").map((p) => `<option>${p}</option>`).join("");
    policy.value = model.get("policy");
    play.textContent = model.get("playing") ? "Pause" : "Play";
    status.textContent = model.get("status");
    if (model.get("playing")) setTimeout(() => model.send({ action: "step" }), model.get("interval_ms"));
  }
  step.onclick = () => model.send({ action: "step" });
  play.onclick = () => { model.set("playing", !model.get("playing")); model.save_changes();
    if (model.get("playing")) model.send({ action: "step" }); };
  layer.onchange = () => { model.set("layer", +layer.value); model.save_changes(); };
  policy.onchange = () => { model.set("policy", policy.value); model.save_changes(); };
  model.on("change:html", draw);
  model.on("change:status", () => { status.textContent = model.get("status"); });
  model.on("change:playing", () => { play.textContent = model.get("playing") ? "Pause" : "Play"; });
  draw();
}
export default { render };
"""


class SessionWidget(anywidget.AnyWidget):
    """A Session's live view. `steps_per_click`: steps a Step click (or one tick of Play) takes."""

    _esm = ESM
    html = traitlets.Unicode("").tag(sync=True)
    layer = traitlets.Int(0).tag(sync=True)
    layers = traitlets.Int(1).tag(sync=True)
    policy = traitlets.Unicode("").tag(sync=True)
    policies = traitlets.List(traitlets.Unicode()).tag(sync=True)
    playing = traitlets.Bool(False).tag(sync=True)
    status = traitlets.Unicode("").tag(sync=True)
    interval_ms = traitlets.Int(100).tag(sync=True)

    def __init__(self, session, steps_per_click: int = 1, **kwargs):
        from pagevis.kvcache.policies import POLICIES

        super().__init__(**kwargs)
        self.session, self.steps_per_click = session, steps_per_click
        self.layers = session.model.config.n_layers
        self.policies = list(POLICIES)
        with self.hold_trait_notifications():
            self.layer, self.policy = session.layer, session.config.policy
        self.observe(self._changed, names=["layer", "policy"])
        self.on_msg(self._message)
        self.redraw()

    def step(self, n: int | None = None) -> None:
        """Step the session (default steps_per_click) and redraw; at its end, stop playing."""
        self.session.step(self.steps_per_click if n is None else n)
        with self.hold_sync():
            if self.session.done:
                self.playing = False
            self.redraw()

    def redraw(self) -> None:
        s = self.session
        with self.hold_sync():  # one message: the browser draws the view and its status together
            self.html = s.view(layer=self.layer).html
            self.status = f"{len(s)} steps" + (f" · done ({s.stop_reason})" if s.done else "")

    def _message(self, _widget, content, _buffers) -> None:
        if content.get("action") == "step" and (not self.session.done):
            self.step()

    @traitlets.validate("layer")
    def _valid_layer(self, proposal) -> int:
        if not 0 <= proposal["value"] < self.layers:
            raise ConfigError("layer", proposal["value"], f"a layer from 0 to {self.layers - 1}")
        return proposal["value"]

    @traitlets.validate("policy")
    def _valid_policy(self, proposal) -> str:
        if self.policies and proposal["value"] not in self.policies:
            raise ConfigError("policy", proposal["value"], f"one of {', '.join(self.policies)}")
        return proposal["value"]

    def _changed(self, change) -> None:
        if change["name"] == "policy" and change["new"] != self.session.config.policy:
            self.session = self.session.with_policy(change["new"])  # a new session: same model, text, settings
        self.redraw()

    def _repr_mimebundle_(self, **kwargs):
        """The widget where widgets render; the static view (text/html) where they do not."""
        bundle = super()._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        data["text/html"] = self.session.view(layer=self.layer).html
        return bundle
