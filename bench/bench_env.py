"""Environment throughput: ALFWorld steps/s per core, upstream TextWorld engine vs ours, same games, same run;
WebShop per catalog. ~1 minute on a 2-core machine.

ALFWorld: one valid_unseen game per task type ($ALFWORLD_DATA after `make data`, else the test games); per
game, each engine plays the stored walkthrough (must win), then 15 seeded random admissible actions; every
observation and admissible list is compared. Figures in CPU time of this one-thread process (other load on
the machine counts against neither engine): steps/s (target: fast >= 3x upstream) and reset/s (first load).

WebShop, per catalog at hand (the shipped sample, $WEBSHOP_DATA, $WEBSHOP_SOURCE): the one-time shop build
(products, goals, BM25 index), search latency (the first 500 goals' solution queries and their short product
queries) and env steps/s of scripted purchases (search, paging, item, sub pages, options, buy).
"""
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from env_servers.alfworld_engine import make_engine  # noqa: E402
from env_servers.alfworld_env import GAME_FILE, GAME_SET, default_data_dir, list_data_tasks  # noqa: E402

N_GAMES = 6
RANDOM_STEPS = 15


def pick_games() -> list[str]:
    """Game files of N_GAMES valid_unseen games, one per task type where possible: from the game set `make
    data` prepared, else the few real games the repository holds for its tests (tests/data)."""
    root = os.path.join(default_data_dir(), GAME_SET)
    if not os.path.isdir(root):
        root = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "alfworld", GAME_SET)
        print(f"no game set in $ALFWORLD_DATA (`make data`): the repository's test games ({root})")
    ids = list_data_tasks(root, "valid_unseen") or list_data_tasks(root, "valid_seen")
    by_type: dict[str, str] = {}
    for t in ids:
        by_type.setdefault(t.split("/")[1].split("-")[0], t)
    chosen = list(by_type.values())
    return [os.path.join(root, t, GAME_FILE) for t in (chosen + [t for t in ids if t not in chosen])[:N_GAMES]]


def play(engine_name: str, game_files: list[str]) -> dict:
    import json
    engine = make_engine(engine_name)
    trace, steps, step_cpu, resets, reset_cpu = [], 0, 0.0, 0, 0.0
    for path in game_files:
        walkthrough = json.load(open(path))["walkthrough"]
        rng = random.Random(path)
        for walk, actions in ((True, walkthrough), (False, [None] * RANDOM_STEPS)):
            t0 = time.process_time()
            if walk:
                engine.load(path)
            state = engine.reset()
            reset_cpu += time.process_time() - t0
            resets += 1
            trace.append((state.feedback, state["admissible_commands"]))
            for action in actions:
                action = action or rng.choice(state["admissible_commands"])
                t0 = time.process_time()
                state, _, _ = engine.step(action)
                step_cpu += time.process_time() - t0
                steps += 1
                trace.append((state.feedback, state["admissible_commands"], state["won"]))
            if walk:
                assert state["won"], f"{engine_name}: walkthrough did not win {path}"
    return {"steps": steps, "steps_per_s": steps / step_cpu, "resets_per_s": resets / reset_cpu, "trace": trace}


def webshop_catalogs() -> list[tuple[str, str]]:
    """(label, directory) of each WebShop catalog at hand: the shipped sample, $WEBSHOP_DATA, $WEBSHOP_SOURCE
    (a local copy `make data` copies from), each catalog once (a copy of one already listed is skipped)."""
    from env_servers.webshop.catalog import PRODUCT_FILES, find_file, has_catalog
    from env_servers.webshop.data import SAMPLE_DIR, default_source
    found: dict[tuple, tuple[str, str]] = {}
    for label, folder in (("shipped sample", SAMPLE_DIR), ("$WEBSHOP_DATA", os.environ.get("WEBSHOP_DATA", "")),
                          ("$WEBSHOP_SOURCE", default_source())):
        if folder and has_catalog(folder):
            products = find_file(folder, PRODUCT_FILES)
            found.setdefault((os.path.basename(products), os.path.getsize(products)), (label, folder))
    return list(found.values())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_webshop(label: str, data_dir: str, num_goals: int = 500) -> None:
    """Shop build time, search latency (wall per query, and CPU per query) and env steps/s of one catalog."""
    from env_servers.webshop import bench_steps_per_second
    from env_servers.webshop.env import get_shop, solution_query

    t0 = time.perf_counter()
    shop = get_shop(data_dir)
    build_s = time.perf_counter() - t0
    print(f"WebShop, {label}: {len(shop.products):,} products, {len(shop.goals):,} goals; shop built in "
          f"{build_s:.1f}s (load, goals, BM25 index)")
    goals = shop.goals[:num_goals]
    for kind, queries in (("goal's words", [solution_query(g) for g in goals]),
                          ("short product query", [g.query or "product" for g in goals])):
        latencies = []
        cpu0 = time.process_time()
        for query in queries:
            t1 = time.perf_counter()
            shop.search(query)
            latencies.append(1000 * (time.perf_counter() - t1))
        cpu_ms = 1000 * (time.process_time() - cpu0) / len(queries)
        words = sum(len(q.split()) for q in queries) / len(queries)
        print(f"  search, {kind} ({words:.1f} words): {sum(latencies) / len(latencies):.2f} ms mean, "
              f"p50 {percentile(latencies, 0.5):.2f}, p95 {percentile(latencies, 0.95):.2f}, "
              f"max {max(latencies):.2f} ms; {cpu_ms:.2f} ms CPU per query ({len(queries)} queries)")
    t0 = time.process_time()
    rate = bench_steps_per_second(2000, data_dir=data_dir)
    print(f"  env: {rate:,.0f} steps/s per core, scripted purchases ({time.process_time() - t0:.1f}s CPU)")


def main() -> None:
    games = pick_games()
    print(f"ALFWorld: {len(games)} valid_unseen games ({', '.join(g.split('/')[-3].split('-')[0] for g in games)})")
    start = time.time()
    up = play("upstream", games)
    fast = play("fast", games)
    identical = up["trace"] == fast["trace"]
    for label, r in (("upstream engine:", up), ("fast engine:", fast)):
        print(f"  {label:16s} {r['steps_per_s']:7.1f} steps/s per core, {r['resets_per_s']:5.2f} resets/s "
              f"({r['steps']} steps)")
    ratio = fast["steps_per_s"] / up["steps_per_s"]
    print(f"  step speed-up: {ratio:.1f}x (target >= 3x: {'met' if ratio >= 3 else 'NOT met'}); "
          f"reset speed-up: {fast['resets_per_s'] / up['resets_per_s']:.1f}x")
    print(f"  observations + admissible lists identical: {identical} ({len(up['trace'])} states compared)")
    print(f"  ({time.time() - start:.0f}s)")
    for label, data_dir in webshop_catalogs():
        bench_webshop(label, data_dir)
    if not identical:
        raise SystemExit("fast engine diverged from upstream")


if __name__ == "__main__":
    main()
