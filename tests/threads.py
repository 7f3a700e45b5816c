"""Run test code on several Python threads at once."""
import threading


def run_in_threads(fn, n):
    """fn(k) for k < n, each on its own thread, started together; returns
    the results in order and raises the first exception a thread raised."""
    results, errors = [None] * n, []

    def run(k):
        try:
            results[k] = fn(k)
        except Exception as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
