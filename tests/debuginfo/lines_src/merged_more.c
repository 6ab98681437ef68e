/* A second unit with functions gcc merges (see merged.c), so that a table
 * built from both has two units whose lines are read when first asked. */
struct more_ops {
	long (*a)(long);
	long (*b)(long);
	long (*c)(long);
};

static long more_a(long v) { return v * 3 + 1; }
static long more_b(long v) { return v * 3 + 1; }
static long more_c(long v) { return v * 3 + 1; }

struct more_ops the_more_ops = { more_a, more_b, more_c };
