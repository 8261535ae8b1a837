"""pagevis.viewmodel: what the windows render, without Qt — the timeline of step records and its spill, the
A/B pair, narration, the attach forest and its layout. The GUI draws these; tests and benches read them
headless."""
