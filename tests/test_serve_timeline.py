"""benchmarks/serve_timeline.py: a deploy's steps read back from Ray Serve's logs, in Ray 2.60's words."""

from datetime import datetime

from benchmarks.serve_timeline import deploy_timeline

CONTROLLER = """\
INFO 2026-12-01 22:00:01,000 controller 22492 -- Deploying new app 'old'.
INFO 2026-12-01 22:07:26,653 controller 22492 -- Deploying new app 'vlm'.
INFO 2026-12-01 22:07:34,326 controller 22492 -- Imported and built app 'vlm' successfully.
INFO 2026-12-01 22:07:34,371 controller 22492 -- Deploying new version of Deployment(name='LLM', app='vlm') (initial target replicas: 2).
INFO 2026-12-01 22:07:34,589 controller 22492 -- Adding 2 replicas to Deployment(name='LLM', app='vlm').
INFO 2026-12-01 22:07:34,591 controller 22492 -- Adding 1 replica to Deployment(name='Router', app='vlm').
INFO 2026-12-01 22:07:45,372 controller 22492 -- Replica(id='1xv575lk', deployment='LLM', app='vlm') started successfully on node 'abc' after 10.8s (PID: 22651). Replica constructor, reconfigure method, and initial health check took 9.1s.
"""
BUILD = "INFO 2026-12-01 22:07:27,751 controller build_vlm_22571 -- Importing application 'vlm' with arguments {}\n"


def test_the_steps_come_back_in_order_relative_to_the_deploy(tmp_path):
    (tmp_path / "controller_22492.log").write_text(CONTROLLER)
    (tmp_path / "controller_build_vlm_22571.log").write_text(BUILD)
    (tmp_path / "replica_vlm_LLM_1xv575lk.log").write_text(CONTROLLER)  # not the controller's: ignored
    since = datetime(2026, 12, 1, 22, 7, 25, 653000).timestamp()  # the deploy call, 1 s before the controller
    got = deploy_timeline(tmp_path, since)
    assert got == [
        {"at_s": 1.0, "event": "controller: deploying the app"},
        {"at_s": 2.1, "event": "builder: its task began importing the app"},
        {"at_s": 8.67, "event": "controller: the app built"},
        {"at_s": 8.94, "event": "controller: 2 LLM replica(s) added"},
        {"at_s": 8.94, "event": "controller: 1 Router replica(s) added"},
        {"at_s": 19.72, "event": "controller: LLM replica 1xv575lk started (10.8 s after it was added)"},
    ]


def test_an_empty_or_missing_log_folder_gives_no_steps(tmp_path):
    assert deploy_timeline(tmp_path, 0.0) == []
    assert deploy_timeline(tmp_path / "absent", 0.0) == []
