"""Progress lines where no bar can be drawn (telemetry/progress_lines.py): a run whose stderr is no terminal (Slurm's
log, nohup, a pipe) printed nothing between its start-up lines and `done:`."""

from dit_train.telemetry.progress_lines import ProgressLines


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def lines_of(total=100, first=0, every_s=60.0):
    clock, printed = Clock(), []
    return ProgressLines(total, first, every_s=every_s, clock=clock, out=printed.append), clock, printed


def test_a_logged_step_prints_at_most_once_a_minute_and_the_last_step_always():
    echo, clock, printed = lines_of()
    for step in range(1, 101):
        clock.now += 5.0  # 5 s a step: a line every 12 steps
        echo(step, {"train/loss": 0.5, "imgs_per_s": 64.0})
    steps = [int(line.split()[1].split("/")[0]) for line in printed]
    assert steps == [1, 13, 25, 37, 49, 61, 73, 85, 97, 100]


def test_the_line_says_where_the_run_is_its_loss_speed_and_time_left_from_its_own_pace():
    echo, clock, printed = lines_of(total=1000, first=200)  # a resume at step 200: the pace is this process's
    clock.now += 150.0
    echo(250, {"train/loss": 0.123456, "imgs_per_s": 812.34})
    # 50 steps in 150 s: 750 steps left take 2250 s
    assert printed == ["step 250/1000 (25.0%), loss 0.1235, imgs/s 812.3, eta 37m30s"]
    clock.now += 3 * 3600.0
    echo(400, {"train/loss": float("nan")})
    assert printed[-1] == "step 400/1000 (40.0%), loss nan, eta 9h07m"  # 200 steps in 10950 s, 600 left: 32850 s


def test_an_evaluation_prints_its_results_and_no_bookkeeping():
    echo, _, printed = lines_of()
    echo(10, {"val/loss": 0.31234, "val/loss_t0.250": 0.2, "val/loss_t0.750": 0.4})
    echo(10, {"ckpt/write_s": 0.9, "ckpt/bytes": 20992183, "ckpt/step": 10})
    echo(20, {"fd/dinov2": 12.3456, "fd/num_samples": 1000, "active_time_s": 50.0, "fd_best/fd": 12.3,
              "encoder": "dinov2_vitb14"})
    assert printed == ["step 10: val/loss 0.3123", "step 20: fd/dinov2 12.35, fd/num_samples 1000"]
