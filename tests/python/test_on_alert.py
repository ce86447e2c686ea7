"""monitor.on_alert: the training process receives the daemon's alerts over
WatchAlerts while it trains (a real run of the demo model with a NaN written
into a weight, the kind of numerical fault ForeshockNonFinite is for)."""
import threading

from demo import train


def test_training_run_receives_its_alert(foreshockd):
    args = train.parse_args(["--endpoint", foreshockd.endpoint, "--run-id", "on-alert",
                             "--steps", "40", "--every", "5", "--fault", "nan",
                             "--fault-step", "20", "--curvature-every", "0", "--log-every", "0"])
    result = train.run(args, out=lambda *_: None)
    events = result["alert_events"]
    firing = [e for e in events if e.to_state == "firing"]
    assert firing, [(e.alert.alertname, e.to_state) for e in events]
    alert = firing[0].alert
    assert alert.alertname == "ForeshockNonFinite" and alert.run == "on-alert"
    assert alert.first_step == 20 and alert.layer == "all"
    assert alert.annotations["probable_cause"] == alert.probable_cause
    assert not [t for t in threading.enumerate() if t.name == "foreshock-alerts"]  # closed
