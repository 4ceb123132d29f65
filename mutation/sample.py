"""Keep a uniform random sample of a cosmic-ray session's mutants (seeded)."""
import random
import sqlite3
import sys

session, size = sys.argv[1], int(sys.argv[2])
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
db = sqlite3.connect(session)
# Order by what the mutation is, not by job id (a fresh uuid per `cosmic-ray init`),
# so the same seed picks the same mutants of the same code.
ids = [row[0] for row in db.execute(
    "select job_id from mutation_specs order by module_path, operator_name, occurrence")]
keep = set(random.Random(seed).sample(ids, min(size, len(ids))))
drop = [(i,) for i in ids if i not in keep]
db.executemany("delete from mutation_specs where job_id = ?", drop)
db.executemany("delete from work_items where job_id = ?", drop)
db.commit()
print(f"kept {len(keep)} of {len(ids)} mutants (seed {seed})")
