"""Keep a uniform random sample of a cosmic-ray session's mutants (seeded)."""
import random
import sqlite3
import sys

session, size = sys.argv[1], int(sys.argv[2])
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
db = sqlite3.connect(session)
ids = [row[0] for row in db.execute("select job_id from work_items order by job_id")]
keep = set(random.Random(seed).sample(ids, min(size, len(ids))))
drop = [(i,) for i in ids if i not in keep]
db.executemany("delete from mutation_specs where job_id = ?", drop)
db.executemany("delete from work_items where job_id = ?", drop)
db.commit()
print(f"kept {len(keep)} of {len(ids)} mutants (seed {seed})")
