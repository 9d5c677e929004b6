/* charllm_nemo._hot: what runs on the training thread between two pieces of training work, in C.
 *
 * Everything here has a Python twin that is used when this module is not built (no C compiler at
 * install) or CHARLLM_PURE_PYTHON=1 is set; tests run both and compare them.
 *
 * 1. MarkBase / Timer: the hot path of train/marks.py (Megatron-Core's timer calls noted in a
 *    step's log).
 * 2. MarkActivity: devices/synthetic.py's MarkActivity (the synthetic device's activity level
 *    from the window marks), a listener the timers call on every mark.
 * 3. write_ring: telemetry/shm.py's write_ring_py (a step's log, a figure request or window
 *    records written into the shared mark ring at step end).
 * 4. FloatSlot: one float64 word of a writable buffer (the shared block's activity level), which
 *    MarkActivity writes directly when it is its on_change: no call, no float object.
 *
 * Megatron-Core runs ``config.timers(name, log_level=...).start()`` and ``.stop()`` between two
 * pieces of training work, ~26 times in a tiny_gpt step. In Python each is two calls (the
 * marker's __call__, the timer's method), each touching a few objects that the training has
 * pushed out of the caches by then. Here both are C: ``MarkBase.__call__`` finds the timer in a
 * dict, ``Timer.start`` / ``Timer.stop`` append (key, CLOCK_MONOTONIC ns) to the step's log (a
 * list) and call the listeners. marks.py holds the same logic in Python (used when this module
 * is not built) and everything else: what the log means, making windows from it at step end.
 *
 * MarkBase (subclassed by marks.StepMarker):
 *   _log        list   the step's marks, flat [key, t, key, t, ...]
 *   _listeners  list   callables told of every begin and end: fn("phase", phase, begin)
 *   _clock      None (clock_gettime(CLOCK_MONOTONIC), as time.monotonic_ns) or a callable
 *   _timers     dict   name -> Timer; a name not in it is handed to self._new_timer(name)
 *   _serial     int    the step in progress (0: none; a new number per step)
 *   unmatched   int    stops without a start in this step, marks outside a step
 * Timer(marker, phase, key_begin, key_end): phase None = not a window (start/stop do nothing).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <stdint.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    PyObject *log;
    PyObject *listeners;
    PyObject *clock;
    PyObject *timers;
    PyObject *dict; /* instance __dict__ (StepMarker's own attributes) */
    PyObject *weakrefs;
    long long serial;
    Py_ssize_t unmatched;
} MarkBase;

typedef struct {
    PyObject_HEAD
    MarkBase *m;
    PyObject *phase;
    PyObject *k_begin;
    PyObject *k_end;
    PyObject *args_begin; /* ("phase", phase, True) */
    PyObject *args_end;
    long long open_in; /* the serial of the step in which it was started (0: not open) */
    PyObject *level_for; /* the MarkActivity whose level index of this phase is cached (or NULL) */
    unsigned long long level_version; /* that MarkActivity's version when it was cached */
    Py_ssize_t level_index;
} Timer;

#define N_LEVELS 3

typedef struct {
    PyObject_HEAD
    PyObject *level_of; /* dict: phase name -> index into levels; other names: index 1 */
    double levels[N_LEVELS];
    double in_step_level;
    double idle_level;
    long long open[N_LEVELS]; /* phases open per activity level */
    long long in_step;
    int seen_any;
    PyObject *on_change; /* None, a FloatSlot (written directly) or a callable(level) */
    double published;
    unsigned long long version; /* a new number at each __init__ (level_of may change) */
} Activity;

typedef struct {
    PyObject_HEAD
    Py_buffer view; /* view.obj NULL once released */
    double *word;
} FloatSlot;

/* Write the slot's word; -1 (no exception set) once it was released. */
static inline int
slot_write(FloatSlot *slot, double level)
{
    if (slot->view.obj == NULL)
        return -1;
    *slot->word = level;
    return 0;
}

static PyTypeObject ActivityType;
static PyTypeObject FloatSlotType;
static int activity_mark(Activity *self, int is_phase, int is_step, Py_ssize_t index, int begin);
static int activity_index(Activity *self, PyObject *name, Py_ssize_t *index);

static PyTypeObject MarkBaseType;
static PyObject *str_phase;   /* "phase" */
static PyObject *str_step;    /* "step" */
static PyObject *str_new_timer; /* "_new_timer" */

/* -- MarkBase ------------------------------------------------------------------------------- */

static int
MarkBase_init(MarkBase *self, PyObject *args, PyObject *kwds)
{
    /* StepMarker.__init__ sets the fields; give them working values first. */
    PyObject *log = PyList_New(0), *listeners = PyList_New(0), *timers = PyDict_New();
    if (log == NULL || listeners == NULL || timers == NULL) {
        Py_XDECREF(log);
        Py_XDECREF(listeners);
        Py_XDECREF(timers);
        return -1;
    }
    Py_XSETREF(self->log, log);
    Py_XSETREF(self->listeners, listeners);
    Py_XSETREF(self->timers, timers);
    Py_INCREF(Py_None);
    Py_XSETREF(self->clock, Py_None);
    return 0;
}

static PyObject *
MarkBase_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    MarkBase *self = (MarkBase *)type->tp_alloc(type, 0);
    if (self != NULL && MarkBase_init(self, NULL, NULL) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
MarkBase_traverse(MarkBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->log);
    Py_VISIT(self->listeners);
    Py_VISIT(self->clock);
    Py_VISIT(self->timers);
    Py_VISIT(self->dict); /* (a subclass's type is visited by subtype_traverse) */
    return 0;
}

static int
MarkBase_clear(MarkBase *self)
{
    Py_CLEAR(self->log);
    Py_CLEAR(self->listeners);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->timers);
    Py_CLEAR(self->dict);
    return 0;
}

/* A subclass's instance comes here from subtype_dealloc, which decrefs the subclass itself. */
static void
MarkBase_dealloc(MarkBase *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    MarkBase_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* config.timers(name, log_level=None): the name's timer. */
static PyObject *
MarkBase_call(MarkBase *self, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) < 1) {
        PyErr_SetString(PyExc_TypeError, "timers() needs the timer's name");
        return NULL;
    }
    PyObject *name = PyTuple_GET_ITEM(args, 0);
    PyObject *timer = PyDict_GetItemWithError(self->timers, name);
    if (timer != NULL) {
        Py_INCREF(timer);
        return timer;
    }
    if (PyErr_Occurred())
        return NULL;
    return PyObject_CallMethodOneArg((PyObject *)self, str_new_timer, name);
}

static int
set_list(PyObject **slot, PyObject *value, const char *what)
{
    if (value == NULL || !PyList_CheckExact(value)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list", what);
        return -1;
    }
    Py_INCREF(value);
    Py_XSETREF(*slot, value);
    return 0;
}

static PyObject *get_log(MarkBase *self, void *c) { return Py_NewRef(self->log); }
static int set_log(MarkBase *self, PyObject *v, void *c) { return set_list(&self->log, v, "_log"); }
static PyObject *get_listeners(MarkBase *self, void *c) { return Py_NewRef(self->listeners); }
static int set_listeners(MarkBase *self, PyObject *v, void *c)
{
    return set_list(&self->listeners, v, "_listeners");
}
static PyObject *get_timers(MarkBase *self, void *c) { return Py_NewRef(self->timers); }
static PyObject *get_clock(MarkBase *self, void *c) { return Py_NewRef(self->clock); }
static int
set_clock(MarkBase *self, PyObject *v, void *c)
{
    if (v == NULL || (v != Py_None && !PyCallable_Check(v))) {
        PyErr_SetString(PyExc_TypeError, "_clock must be None or a callable");
        return -1;
    }
    Py_INCREF(v);
    Py_XSETREF(self->clock, v);
    return 0;
}

static PyGetSetDef MarkBase_getset[] = {
    {"_log", (getter)get_log, (setter)set_log, "the step's marks, flat [key, t, ...]", NULL},
    {"_listeners", (getter)get_listeners, (setter)set_listeners, "told of every begin and end", NULL},
    {"_timers", (getter)get_timers, NULL, "name -> timer", NULL},
    {"_clock", (getter)get_clock, (setter)set_clock, "None: CLOCK_MONOTONIC ns; else a callable", NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyMemberDef MarkBase_members[] = {
    {"_serial", T_LONGLONG, offsetof(MarkBase, serial), 0, "the step in progress (0: none)"},
    {"unmatched", T_PYSSIZET, offsetof(MarkBase, unmatched), 0, "stops without a start, marks outside a step"},
    {NULL},
};

static PyTypeObject MarkBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "charllm_nemo._hot.MarkBase",
    .tp_basicsize = sizeof(MarkBase),
    .tp_dealloc = (destructor)MarkBase_dealloc,
    .tp_call = (ternaryfunc)MarkBase_call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "config.timers in C: the name's timer (subclassed by marks.StepMarker)",
    .tp_traverse = (traverseproc)MarkBase_traverse,
    .tp_clear = (inquiry)MarkBase_clear,
    .tp_getset = MarkBase_getset,
    .tp_members = MarkBase_members,
    .tp_dictoffset = offsetof(MarkBase, dict),
    .tp_weaklistoffset = offsetof(MarkBase, weakrefs),
    .tp_new = MarkBase_new,
};

/* -- Timer ---------------------------------------------------------------------------------- */

static int
Timer_init(Timer *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"marker", "phase", "key_begin", "key_end", NULL};
    PyObject *m, *phase, *kb, *ke;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO!O!", kwlist, &MarkBaseType, &m, &phase, &PyLong_Type,
                                     &kb, &PyLong_Type, &ke))
        return -1;
    PyObject *ab = PyTuple_Pack(3, str_phase, phase, Py_True);
    PyObject *ae = PyTuple_Pack(3, str_phase, phase, Py_False);
    if (ab == NULL || ae == NULL) {
        Py_XDECREF(ab);
        Py_XDECREF(ae);
        return -1;
    }
    Py_INCREF(m);
    Py_XSETREF(self->m, (MarkBase *)m);
    Py_INCREF(phase);
    Py_XSETREF(self->phase, phase);
    Py_INCREF(kb);
    Py_XSETREF(self->k_begin, kb);
    Py_INCREF(ke);
    Py_XSETREF(self->k_end, ke);
    Py_XSETREF(self->args_begin, ab);
    Py_XSETREF(self->args_end, ae);
    self->open_in = 0;
    Py_CLEAR(self->level_for);
    return 0;
}

static int
Timer_traverse(Timer *self, visitproc visit, void *arg)
{
    Py_VISIT(self->m);
    Py_VISIT(self->phase);
    Py_VISIT(self->args_begin);
    Py_VISIT(self->args_end);
    Py_VISIT(self->level_for);
    return 0;
}

static int
Timer_clear(Timer *self)
{
    Py_CLEAR(self->m);
    Py_CLEAR(self->phase);
    Py_CLEAR(self->k_begin);
    Py_CLEAR(self->k_end);
    Py_CLEAR(self->args_begin);
    Py_CLEAR(self->args_end);
    Py_CLEAR(self->level_for);
    return 0;
}

static void
Timer_dealloc(Timer *self)
{
    PyObject_GC_UnTrack(self);
    Timer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A MarkActivity listener told of the timer's begin or end directly: no argument tuple, and the
 * phase's level index looked up once per MarkActivity (and again after its __init__). */
static int
tell_activity(Timer *timer, Activity *act, int begin)
{
    if (timer->level_for != (PyObject *)act || timer->level_version != act->version) {
        Py_ssize_t index;
        if (activity_index(act, timer->phase, &index) < 0)
            return -1;
        Py_INCREF(act);
        Py_XSETREF(timer->level_for, (PyObject *)act);
        timer->level_version = act->version;
        timer->level_index = index;
    }
    return activity_mark(act, 1, 0, timer->level_index, begin);
}

/* Append (key, clock reading) to the step's log, then tell the listeners. */
static int
note(Timer *timer, int begin)
{
    MarkBase *m = timer->m;
    PyObject *t;
    if (m->log == NULL || m->listeners == NULL || m->clock == NULL)
        return 0; /* cleared by the garbage collector (a cycle being torn down) */
    if (m->clock == Py_None) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        t = PyLong_FromLongLong((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    }
    else {
        t = PyObject_CallNoArgs(m->clock);
    }
    if (t == NULL)
        return -1;
    PyObject *log = m->log; /* held: a listener may replace m->log */
    Py_INCREF(log);
    int rc = (PyList_Append(log, begin ? timer->k_begin : timer->k_end) < 0 || PyList_Append(log, t) < 0) ? -1 : 0;
    Py_DECREF(log);
    Py_DECREF(t);
    if (rc < 0)
        return -1;
    PyObject *ls = m->listeners; /* held: a listener may replace m->listeners */
    Py_INCREF(ls);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ls); i++) { /* the size is read again: may grow */
        PyObject *fn = PyList_GET_ITEM(ls, i);
        Py_INCREF(fn);
        PyObject *r;
        if (PyObject_TypeCheck(fn, &ActivityType) && Py_TYPE(fn)->tp_call == ActivityType.tp_call)
            r = tell_activity(timer, (Activity *)fn, begin) < 0 ? NULL : Py_NewRef(Py_None);
        else
            r = PyObject_Call(fn, begin ? timer->args_begin : timer->args_end, NULL);
        Py_DECREF(fn);
        if (r == NULL) {
            Py_DECREF(ls);
            return -1;
        }
        Py_DECREF(r);
    }
    Py_DECREF(ls);
    return 0;
}

static PyObject *
Timer_start(Timer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    MarkBase *m = self->m;
    if (self->phase == Py_None || m == NULL)
        Py_RETURN_NONE;
    if (m->serial == 0) {
        m->unmatched++;
        Py_RETURN_NONE;
    }
    self->open_in = m->serial;
    if (note(self, 1) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Timer_stop(Timer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    MarkBase *m = self->m;
    if (self->phase == Py_None || m == NULL)
        Py_RETURN_NONE;
    if (m->serial == 0 || self->open_in != m->serial) {
        m->unmatched++;
        Py_RETURN_NONE;
    }
    self->open_in = 0;
    if (note(self, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Timer_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Timer_start, METH_FASTCALL | METH_KEYWORDS,
     "start(barrier=False): note the phase's begin (arguments ignored, as mcore passes them)"},
    {"stop", (PyCFunction)(void (*)(void))Timer_stop, METH_FASTCALL | METH_KEYWORDS,
     "stop(barrier=False): note the phase's end when the timer is open in this step"},
    {NULL},
};

static PyMemberDef Timer_members[] = {
    {"_phase", T_OBJECT, offsetof(Timer, phase), READONLY, "the window's phase name (None: not a window)"},
    {"_k_begin", T_OBJECT, offsetof(Timer, k_begin), READONLY, "the begin mark's key"},
    {"_k_end", T_OBJECT, offsetof(Timer, k_end), READONLY, "the end mark's key"},
    {"_open_in", T_LONGLONG, offsetof(Timer, open_in), READONLY, "the step it was started in (0: none)"},
    {NULL},
};

static PyTypeObject TimerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "charllm_nemo._hot.Timer",
    .tp_basicsize = sizeof(Timer),
    .tp_dealloc = (destructor)Timer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Timer(marker, phase, key_begin, key_end): what config.timers(name) returns",
    .tp_traverse = (traverseproc)Timer_traverse,
    .tp_clear = (inquiry)Timer_clear,
    .tp_methods = Timer_methods,
    .tp_members = Timer_members,
    .tp_init = (initproc)Timer_init,
    .tp_new = PyType_GenericNew,
};

/* -- MarkActivity -------------------------------------------------------------------------- */

static int
Activity_init(Activity *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"level_of", "levels", "in_step", "idle", NULL};
    PyObject *level_of;
    double in_step, idle;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!(ddd)dd", kwlist, &PyDict_Type, &level_of, &self->levels[0],
                                     &self->levels[1], &self->levels[2], &in_step, &idle))
        return -1;
    Py_INCREF(level_of);
    Py_XSETREF(self->level_of, level_of);
    self->in_step_level = in_step;
    self->idle_level = idle;
    for (int i = 0; i < N_LEVELS; i++)
        self->open[i] = 0;
    self->in_step = 0;
    self->seen_any = 0;
    Py_INCREF(Py_None);
    Py_XSETREF(self->on_change, Py_None);
    self->published = -1.0;
    self->version++;
    return 0;
}

/* Working values before __init__ (or without it: MarkActivity.__new__(MarkActivity)). */
static PyObject *
Activity_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Activity *self = (Activity *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->level_of = PyDict_New();
    if (self->level_of == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->on_change = Py_NewRef(Py_None);
    self->published = -1.0;
    return (PyObject *)self;
}

static int
Activity_traverse(Activity *self, visitproc visit, void *arg)
{
    Py_VISIT(self->level_of);
    Py_VISIT(self->on_change);
    return 0;
}

static int
Activity_clear(Activity *self)
{
    Py_CLEAR(self->level_of);
    Py_CLEAR(self->on_change);
    return 0;
}

static void
Activity_dealloc(Activity *self)
{
    PyObject_GC_UnTrack(self);
    Activity_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static double
activity_level(Activity *self)
{
    for (int i = 0; i < N_LEVELS; i++)
        if (self->open[i])
            return self->levels[i];
    return self->in_step > 0 ? self->in_step_level : self->idle_level;
}

static int
is_kind(PyObject *kind, PyObject *interned)
{
    return kind == interned || (PyUnicode_Check(kind) && PyUnicode_Compare(kind, interned) == 0);
}

/* The index into levels of a phase named ``name``. */
static int
activity_index(Activity *self, PyObject *name, Py_ssize_t *index)
{
    *index = 1;
    PyObject *idx = PyDict_GetItemWithError(self->level_of, name);
    if (idx == NULL)
        return PyErr_Occurred() ? -1 : 0;
    Py_ssize_t i = PyLong_AsSsize_t(idx);
    if (i < 0 || i >= N_LEVELS) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "level_of: an index out of range");
        return -1;
    }
    *index = i;
    return 0;
}

/* Where the level is published to was released (the session is stopping): stop publishing. */
static void
drop_on_change(Activity *self)
{
    Py_INCREF(Py_None);
    Py_XSETREF(self->on_change, Py_None);
}

/* A mark: a phase of level ``index`` (is_phase) or the step (is_step) begins or ends; anything
 * else only counts as seen. Publishes the level when it changed. */
static int
activity_mark(Activity *self, int is_phase, int is_step, Py_ssize_t index, int begin)
{
    self->seen_any = 1;
    if (is_phase) {
        long long n = self->open[index] + (begin ? 1 : -1);
        self->open[index] = n > 0 ? n : 0;
    }
    else if (is_step)
        self->in_step += begin ? 1 : -1;
    if (self->on_change == Py_None)
        return 0;
    double level = activity_level(self);
    if (level == self->published)
        return 0;
    self->published = level;
    if (Py_IS_TYPE(self->on_change, &FloatSlotType)) {
        if (slot_write((FloatSlot *)self->on_change, level) < 0)
            drop_on_change(self);
        return 0;
    }
    PyObject *v = PyFloat_FromDouble(level);
    if (v == NULL)
        return -1;
    PyObject *fn = Py_NewRef(self->on_change); /* held: the call may replace it */
    PyObject *r = PyObject_CallOneArg(fn, v);
    Py_DECREF(fn);
    Py_DECREF(v);
    if (r == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError) && !PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear();
        drop_on_change(self);
    }
    Py_XDECREF(r);
    return 0;
}

/* listener(kind, name, is_begin) */
static PyObject *
Activity_call(Activity *self, PyObject *args, PyObject *kwds)
{
    if (kwds != NULL || PyTuple_GET_SIZE(args) != 3) {
        PyErr_SetString(PyExc_TypeError, "MarkActivity(kind, name, is_begin)");
        return NULL;
    }
    PyObject *kind = PyTuple_GET_ITEM(args, 0);
    int begin = PyObject_IsTrue(PyTuple_GET_ITEM(args, 2));
    if (begin < 0)
        return NULL;
    int is_phase = is_kind(kind, str_phase);
    Py_ssize_t index = 1;
    if (is_phase && activity_index(self, PyTuple_GET_ITEM(args, 1), &index) < 0)
        return NULL;
    if (activity_mark(self, is_phase, !is_phase && is_kind(kind, str_step), index, begin) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Activity_level(Activity *self, PyObject *unused)
{
    return PyFloat_FromDouble(activity_level(self));
}

static PyObject *
get_on_change(Activity *self, void *c)
{
    return Py_NewRef(self->on_change);
}

static int
set_on_change(Activity *self, PyObject *v, void *c)
{
    if (v == NULL || (v != Py_None && !PyCallable_Check(v))) {
        PyErr_SetString(PyExc_TypeError, "on_change must be None or a callable");
        return -1;
    }
    Py_INCREF(v);
    Py_XSETREF(self->on_change, v);
    return 0;
}

static PyObject *
get_seen_any(Activity *self, void *c)
{
    return PyBool_FromLong(self->seen_any);
}

static PyGetSetDef Activity_getset[] = {
    {"on_change", (getter)get_on_change, (setter)set_on_change, "called with the level when it changes", NULL},
    {"seen_any", (getter)get_seen_any, NULL, "whether any mark has arrived", NULL},
    {NULL},
};

static PyMethodDef Activity_methods[] = {
    {"level", (PyCFunction)Activity_level, METH_NOARGS, "the activity level now"},
    {NULL},
};

static PyTypeObject ActivityType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "charllm_nemo._hot.MarkActivity",
    .tp_basicsize = sizeof(Activity),
    .tp_dealloc = (destructor)Activity_dealloc,
    .tp_call = (ternaryfunc)Activity_call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "MarkActivity(level_of, levels, in_step, idle): devices/synthetic.py's MarkActivity in C",
    .tp_traverse = (traverseproc)Activity_traverse,
    .tp_clear = (inquiry)Activity_clear,
    .tp_methods = Activity_methods,
    .tp_getset = Activity_getset,
    .tp_init = (initproc)Activity_init,
    .tp_new = Activity_new,
};

/* -- FloatSlot ----------------------------------------------------------------------------- */

/* FloatSlot(buffer, index): float64 word ``index`` of the writable ``buffer``, held (exported)
 * until release(). slot(level) writes it; a MarkActivity whose on_change is a FloatSlot writes it
 * itself. Once released, slot(level) raises ValueError and a MarkActivity drops it, as it drops
 * an on_change that raises ValueError. */
static int
FloatSlot_init(FloatSlot *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "index", NULL};
    PyObject *buffer;
    Py_ssize_t index;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "On", kwlist, &buffer, &index))
        return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE) < 0)
        return -1;
    if (index < 0 || index >= view.len / (Py_ssize_t)sizeof(double) || ((uintptr_t)view.buf) % sizeof(double)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "FloatSlot: index outside the buffer, or the buffer not 8-aligned");
        return -1;
    }
    if (self->view.obj != NULL)
        PyBuffer_Release(&self->view);
    self->view = view;
    self->word = (double *)view.buf + index;
    return 0;
}

static void
FloatSlot_dealloc(FloatSlot *self)
{
    if (self->view.obj != NULL)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
FloatSlot_call(FloatSlot *self, PyObject *args, PyObject *kwds)
{
    double level;
    if (!PyArg_ParseTuple(args, "d:FloatSlot", &level))
        return NULL;
    if (slot_write(self, level) < 0) {
        PyErr_SetString(PyExc_ValueError, "FloatSlot: released");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
FloatSlot_release(FloatSlot *self, PyObject *unused)
{
    if (self->view.obj != NULL)
        PyBuffer_Release(&self->view);
    self->word = NULL;
    Py_RETURN_NONE;
}

static PyObject *
get_released(FloatSlot *self, void *c)
{
    return PyBool_FromLong(self->view.obj == NULL);
}

static PyMethodDef FloatSlot_methods[] = {
    {"release", (PyCFunction)FloatSlot_release, METH_NOARGS, "let the buffer go (later writes raise ValueError)"},
    {NULL},
};

static PyGetSetDef FloatSlot_getset[] = {
    {"released", (getter)get_released, NULL, "whether release() was called", NULL},
    {NULL},
};

static PyTypeObject FloatSlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "charllm_nemo._hot.FloatSlot",
    .tp_basicsize = sizeof(FloatSlot),
    .tp_dealloc = (destructor)FloatSlot_dealloc,
    .tp_call = (ternaryfunc)FloatSlot_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "FloatSlot(buffer, index): one float64 word of a writable buffer; slot(level) writes it",
    .tp_methods = FloatSlot_methods,
    .tp_getset = FloatSlot_getset,
    .tp_init = (initproc)FloatSlot_init,
    .tp_new = PyType_GenericNew,
};

/* -- write_ring ----------------------------------------------------------------------------- */

/* write_ring(buffer, base, cap, w, record_len, *parts) -> records written
 *
 * The ints of ``parts`` (lists or tuples of ints), one after another and zero-padded to whole
 * records of ``record_len`` int64 words, written into a ring of ``cap`` records that starts at
 * byte ``base`` of the writable ``buffer``, from record ``w % cap`` on (wrapping to record 0).
 * The caller checks the room and publishes the new write position (telemetry/shm.py MarkWriter,
 * whose Python twin this is): a step's log goes into the mark ring in one call, with no list
 * built for it. Raises ValueError when the ints do not fit in the ring or the buffer, OverflowError
 * for an int outside int64. */
static PyObject *
write_ring(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 5) {
        PyErr_SetString(PyExc_TypeError, "write_ring(buffer, base, cap, w, record_len, *parts)");
        return NULL;
    }
    long long ints[4]; /* base, cap, w, record_len: each checked as it is converted */
    for (int k = 0; k < 4; k++) {
        ints[k] = PyLong_AsLongLong(args[1 + k]);
        if (ints[k] == -1 && PyErr_Occurred())
            return NULL;
    }
    long long base = ints[0], cap = ints[1], w = ints[2], rlen = ints[3];
    if (base < 0 || cap <= 0 || w < 0 || rlen <= 0 || base % 8 != 0) {
        PyErr_SetString(PyExc_ValueError,
                        "write_ring: base (a multiple of 8), w >= 0 and cap, record_len > 0");
        return NULL;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t p = 5; p < nargs; p++) {
        if (!PyList_Check(args[p]) && !PyTuple_Check(args[p])) {
            PyErr_SetString(PyExc_TypeError, "write_ring: the parts must be lists or tuples of ints");
            return NULL;
        }
        total += PySequence_Fast_GET_SIZE(args[p]);
    }
    long long n = total / rlen + (total % rlen != 0);
    if (n > cap) {
        PyErr_SetString(PyExc_ValueError, "write_ring: more records than the ring holds");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    PyObject *result = NULL;
    /* base + cap * rlen * 8 <= view.len, without overflowing on the way */
    if (rlen > LLONG_MAX / 8 || base > (long long)view.len
        || cap > ((long long)view.len - base) / (rlen * 8)) {
        PyErr_SetString(PyExc_ValueError, "write_ring: the ring does not fit in the buffer");
        goto done;
    }
    long long *ring = (long long *)((char *)view.buf + base);
    long long words = cap * rlen, pos = (w % cap) * rlen, written = 0;
    for (Py_ssize_t p = 5; p < nargs; p++) {
        PyObject *part = args[p];
        /* The size and items are read again each time: an int-like item's __index__ may change
         * a list; no more than the n records counted (and checked for room) are ever written. */
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(part) && written < n * rlen; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(part, i);
            long long v;
            if (PyLong_CheckExact(item)) {
                v = PyLong_AsLongLong(item);
            }
            else {
                Py_INCREF(item);
                PyObject *index = PyNumber_Index(item); /* numpy ints and the like */
                Py_DECREF(item);
                if (index == NULL)
                    goto done;
                v = PyLong_AsLongLong(index);
                Py_DECREF(index);
            }
            if (v == -1 && PyErr_Occurred())
                goto done;
            ring[pos] = v;
            if (++pos == words)
                pos = 0;
            written++;
        }
    }
    for (; written < n * rlen; written++) {
        ring[pos] = 0;
        if (++pos == words)
            pos = 0;
    }
    result = PyLong_FromLongLong(n);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef hot_functions[] = {
    {"write_ring", (PyCFunction)(void (*)(void))write_ring, METH_FASTCALL,
     "write_ring(buffer, base, cap, w, record_len, *parts) -> records written (telemetry/shm.py)"},
    {NULL},
};

/* -- module --------------------------------------------------------------------------------- */

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "charllm_nemo._hot",
    .m_doc = "What runs on the training thread between two pieces of training work, in C.",
    .m_size = -1,
    .m_methods = hot_functions,
};

PyMODINIT_FUNC
PyInit__hot(void)
{
    str_phase = PyUnicode_InternFromString("phase");
    str_step = PyUnicode_InternFromString("step");
    str_new_timer = PyUnicode_InternFromString("_new_timer");
    if (str_phase == NULL || str_step == NULL || str_new_timer == NULL)
        return NULL;
    if (PyType_Ready(&MarkBaseType) < 0 || PyType_Ready(&TimerType) < 0 || PyType_Ready(&ActivityType) < 0
        || PyType_Ready(&FloatSlotType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&hot_module);
    if (mod == NULL)
        return NULL;
    if (PyModule_AddObjectRef(mod, "MarkBase", (PyObject *)&MarkBaseType) < 0 ||
        PyModule_AddObjectRef(mod, "Timer", (PyObject *)&TimerType) < 0 ||
        PyModule_AddObjectRef(mod, "MarkActivity", (PyObject *)&ActivityType) < 0 ||
        PyModule_AddObjectRef(mod, "FloatSlot", (PyObject *)&FloatSlotType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
