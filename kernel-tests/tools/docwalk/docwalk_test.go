package docwalk

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// A reference is a backquoted span of a walk: `file.go:Name`,
// `file.go:Type.Method`, or `X.Y` (a method or field of type X, or a name
// of package X). A leading * or [] is a type's spelling, not its name.
var (
	span    = regexp.MustCompile("`([^`\n]+)`")
	withGo  = regexp.MustCompile(`^(?:[\w./-]*/)?(\w+\.go):([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?$`)
	dotted  = regexp.MustCompile(`^(?:\*|\[\])*([A-Za-z_]\w*)\.([A-Za-z_]\w*)$`)
	heading = regexp.MustCompile(`(?m)^## `)
)

// notGo are dotted spans of the walks that name files of the kernel, not Go;
// fileExt, the endings of the other files a walk may name (`rankchan.c`).
var (
	notGo   = map[string]bool{"cgroup.events": true, "cgroup.procs": true}
	fileExt = map[string]bool{"c": true, "h": true, "so": true, "md": true, "sh": true, "go": true, "conf": true, "service": true}
)

// index is what the repository's Go sources declare.
type index struct {
	inFile  map[string]map[string]bool // file base name -> "Name" and "Type.Method"
	members map[string]bool            // "Type.Method", "Type.Field"
	inPkg   map[string]bool            // "pkg.Name" of a package-level name
}

func root(t *testing.T) string {
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.work")); err == nil {
			return dir
		}
		up := filepath.Dir(dir)
		if up == dir {
			t.Fatal("no go.work above the test's directory")
		}
		dir = up
	}
}

func recvName(e ast.Expr) string {
	for {
		switch x := e.(type) {
		case *ast.StarExpr:
			e = x.X
		case *ast.IndexExpr:
			e = x.X
		case *ast.IndexListExpr:
			e = x.X
		case *ast.Ident:
			return x.Name
		default:
			return ""
		}
	}
}

func build(t *testing.T, top string) index {
	ix := index{inFile: map[string]map[string]bool{}, members: map[string]bool{}, inPkg: map[string]bool{}}
	fset := token.NewFileSet()
	err := filepath.WalkDir(top, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); path != top && (strings.HasPrefix(n, ".") || n == "testdata" || n == "vendor" || n == "bin") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		base := filepath.Base(path)
		if ix.inFile[base] == nil {
			ix.inFile[base] = map[string]bool{}
		}
		pkg := f.Name.Name
		add := func(name string) {
			ix.inFile[base][name] = true
			ix.inPkg[pkg+"."+name] = true
		}
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv != nil && len(d.Recv.List) == 1 {
					m := recvName(d.Recv.List[0].Type) + "." + d.Name.Name
					ix.inFile[base][m] = true
					ix.members[m] = true
				} else {
					add(d.Name.Name)
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						add(s.Name.Name)
						if st, ok := s.Type.(*ast.StructType); ok {
							for _, fl := range st.Fields.List {
								for _, n := range fl.Names {
									ix.members[s.Name.Name+"."+n.Name] = true
								}
								if len(fl.Names) == 0 { // embedded
									ix.members[s.Name.Name+"."+recvName(fl.Type)] = true
								}
							}
						}
						if it, ok := s.Type.(*ast.InterfaceType); ok {
							for _, m := range it.Methods.List {
								for _, n := range m.Names {
									ix.members[s.Name.Name+"."+n.Name] = true
								}
							}
						}
					case *ast.ValueSpec:
						for _, n := range s.Names {
							add(n.Name)
						}
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ix
}

// walks returns the text of every "## Walking ..." section.
func walks(t *testing.T, doc string) map[string]string {
	out := map[string]string{}
	locs := heading.FindAllStringIndex(doc, -1)
	for i, l := range locs {
		end := len(doc)
		if i+1 < len(locs) {
			end = locs[i+1][0]
		}
		sec := doc[l[0]:end]
		title, _, _ := strings.Cut(sec[3:], "\n")
		if strings.HasPrefix(title, "Walking ") {
			out[title] = sec
		}
	}
	return out
}

// check returns one line per reference of text that names nothing the
// repository declares, and how many references it checked.
func check(ix index, text string) (missing []string, n int) {
	for _, m := range span.FindAllStringSubmatch(text, -1) {
		ref := m[1]
		if g := withGo.FindStringSubmatch(ref); g != nil {
			n++
			name := g[2]
			if g[3] != "" {
				name += "." + g[3]
			}
			if !ix.inFile[g[1]][name] {
				missing = append(missing, ref+": no "+name+" declared in a file named "+g[1])
			}
			continue
		}
		d := dotted.FindStringSubmatch(ref)
		if d == nil || notGo[ref] || fileExt[d[2]] {
			continue
		}
		n++
		key := d[1] + "." + d[2]
		if !ix.members[key] && !ix.inPkg[key] {
			missing = append(missing, ref+": no method or field "+key+", and no package "+d[1]+" declaring "+d[2])
		}
	}
	return missing, n
}

func TestWalksNameWhatExists(t *testing.T) {
	top := root(t)
	b, err := os.ReadFile(filepath.Join(top, "docs", "ARCHITECTURE.md"))
	if err != nil {
		t.Fatal(err)
	}
	ws := walks(t, string(b))
	for _, want := range []string{"Walking a pause", "Walking a registration"} {
		if ws[want] == "" {
			t.Errorf("docs/ARCHITECTURE.md has no section %q", want)
		}
	}
	ix := build(t, top)
	for title, text := range ws {
		missing, n := check(ix, text)
		for _, m := range missing {
			t.Errorf("docs/ARCHITECTURE.md, %q: %s", title, m)
		}
		if n < 10 {
			t.Errorf("docs/ARCHITECTURE.md, %q: only %d references to Go names; is the parser still reading it?", title, n)
		}
	}
}

func TestCheckFindsAMissingName(t *testing.T) {
	ix := index{
		inFile:  map[string]map[string]bool{"a.go": {"Run": true, "T.M": true}},
		members: map[string]bool{"T.M": true},
		inPkg:   map[string]bool{"p.Run": true},
	}
	missing, n := check(ix, "`a.go:Run`, `a.go:T.M`, `T.M`, `p.Run`, `*p.Run`, `cgroup.events`, `x.c`, `a.go:Gone`, `T.Gone`, `q.Run`")
	if n != 8 || len(missing) != 3 {
		t.Fatalf("checked %d, missing %q; want 8 checked, 3 missing", n, missing)
	}
}
