"""A step ramp for loadtest/locustfile.py: pass both files (`-f loadtest/locustfile.py,loadtest/step_shape.py`).

Users grow by --step-users every --step-time seconds up to -u, then hold until --run-time ends.
"""

from locust import LoadTestShape


class StepLoadShape(LoadTestShape):
    def tick(self):
        options = self.runner.environment.parsed_options
        elapsed = self.get_run_time()
        if options.run_time and elapsed > options.run_time:
            return None
        users = min(options.num_users, options.step_users * (1 + int(elapsed // options.step_time)))
        return users, users  # spawn rate: a whole step at once
