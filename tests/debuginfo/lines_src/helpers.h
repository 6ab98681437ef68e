/* Inlined into every caller at -O2: the frames the line table must chain. */
static int counter;

static inline int leaf(int x)
{
	counter += x;
	return x * 3 + counter;
}

static inline int mid(int x)
{
	int r = leaf(x) ^ leaf(x + 1);

	if (r & 1)
		r += leaf(r);
	return r + 7;
}
