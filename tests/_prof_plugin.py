import time
import pytest

@pytest.fixture(autouse=True)
def _time_exports(monkeypatch):
    from modes import export
    orig = export.export
    def timed(*a, **k):
        t = time.time(); r = orig(*a, **k); print('export', a[2], round(time.time()-t,2), flush=True); return r
    monkeypatch.setattr(export, 'export', timed)
    fn = export.format_named
    def fnamed(name):
        f = fn(name)
        run = f.run
        def timed_run(*a, **k):
            t=time.time(); r=run(*a, **k); print('run', name, round(time.time()-t,2), flush=True); return r
        f.run = timed_run
        return f
    monkeypatch.setattr(export, 'format_named', fnamed)
