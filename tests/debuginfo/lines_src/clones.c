/* Functions gcc -O2 clones under a suffixed ELF name (scale.constprop.0,
 * area.isra.0, check.part.0) while the DWARF keeps the source name, and an
 * assembly function (asm_add, in asm_add.S) that has no DWARF subprogram. */
struct box {
	int w, h, d[8];
};

int asm_add(int a, int b);

static __attribute__((noinline)) int scale(int x, int k)
{
	int s = 0;

	for (int i = 0; i < x; i++)
		s += i * k + (s >> 3);
	return s;
}

static __attribute__((noinline)) int area(struct box *b)
{
	return b->w * b->h + (b->w ^ b->h) * 7;
}

static int check(const int *p, int n)
{
	if (!p)
		return -1;
	int s = 0;
	for (int i = 0; i < n; i++) {
		s += p[i] * p[i] + (s >> 2);
		if (s > 100000)
			s -= p[i] * 3;
	}
	for (int i = 0; i < n; i++)
		s ^= p[i] << (i & 7);
	return s;
}

int use_clones(int x, const int *p)
{
	struct box b = { x, x + 1, { 0 } };

	return scale(x, 3) + scale(x + 1, 3) + area(&b) + check(p, x) + check(p + 1, x) +
	       asm_add(x, 2);
}
